"""A bare `pip install flexjax` serves every CPU entry point: tests/bare_install.py's checks with the optional
packages (absl-py, flax, Triton, jax-triton, torch) hidden, in a fresh process. `make test-bare` runs the same
script, README examples included, in a venv that has no extras."""

import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("bare_install.py")


@pytest.mark.ci_extra  # (make test-extra: a fresh process; make test-bare runs the same script)
def test_entry_points_without_optional_packages():
    run = subprocess.run([sys.executable, str(SCRIPT), "--hide-optional", "--skip-readme"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "bare install: every check passed" in run.stdout
    assert "backend='triton' refuses" in run.stdout and "flexjax[gpu]" in run.stdout
