"""`python -m flexjax demo` and `show-mask` run end to end in a subprocess."""

import os
import subprocess
import sys

import pytest


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "flexjax", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "MPLBACKEND": "Agg"})


@pytest.mark.ci_extra  # (make test-extra: 3-9 s; cheaper siblings run in make test)
def test_demo_small():
    r = _run("demo", "--small")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "█" in out and "░" in out  # to_string pictures
    assert out.count(" OK") == 4 and "FAIL" not in out
    for row in ("flexjax.flex_attention", "dense jnp", "jax.nn.dot_product_attention"):
        assert row in out
    assert "demo passed" in out


@pytest.mark.parametrize("name,extra", [("causal", []),
                                        pytest.param("sliding_window", ["--window", "64"], marks=pytest.mark.slow),
                                        pytest.param("prefix_lm", [], marks=pytest.mark.slow),
                                        ("document", ["--docs", "3"]),
                                        pytest.param("chunked_causal", ["--chunk", "128"], marks=pytest.mark.slow)])
def test_show_mask(name, extra):
    r = _run("show-mask", name, "--seq", "512", "--block", "64", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BlockMask(shape=(1, 1, 512, 512)" in r.stdout
    assert "b=0, h=0" in r.stdout


@pytest.mark.ci_extra  # (make test's budget; test_plot.py draws masks in make test)
def test_show_mask_saves_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "mask.png"
    r = _run("show-mask", "sliding_window", "--seq", "1024", "--window", "100", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.exists() and out.stat().st_size > 5000


def test_show_mask_unknown_name():
    r = _run("show-mask", "no_such_mask")
    assert r.returncode != 0
    assert "invalid choice" in r.stderr
