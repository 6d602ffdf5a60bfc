"""Several hosts, simulated: examples/two_process.py starts two processes joined by jax.distributed over
loopback (2 CPU devices each, gloo collectives), and each checks that data parallelism and context parallelism
(ring and all-gather, load-balanced) over a mesh of both processes' devices give the one-process output and dq.
10-20 s on 2 cores; in CI through `make test-extra`."""

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "two_process.py"
CHECKS = ("data parallel", "context parallel, ring", "context parallel, all-gather")


@pytest.mark.ci_extra  # (make test-extra: 10-20 s on 2 cores)
def test_two_processes_match_one_process():
    # The example kills both processes past --timeout; the outer timeout is a backstop.
    result = subprocess.run([sys.executable, str(EXAMPLE), "--timeout", "150"], capture_output=True, text=True,
                            timeout=200)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for i in (0, 1):
        ok = re.findall(rf"^\[process {i}\] ok: (.*)$", out, re.M)
        assert [next(c for c in CHECKS if line.startswith(c)) for line in ok] == list(CHECKS), out
        assert f"[process {i}] 3 of 3 checks passed" in out, out
        assert f"[process {i}] process {i} of 2: " in out, out
    assert "both processes passed" in out, out
