"""plot_block_mask draws tiles (and the element mask for short sequences) to a PNG."""

import builtins
import sys

import numpy as np
import pytest

import flexjax
from flexjax import masks

pytest.importorskip("matplotlib")

from flexjax._plot import element_mask, plot_block_mask  # noqa: E402


def _png_ok(fig, path):
    fig.savefig(path, dpi=60)
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert path.exists() and path.stat().st_size > 3000
    from matplotlib.image import imread

    img = imread(path)
    assert img.std() > 0.05  # not a blank canvas


def test_plot_small_mask_has_element_panel(tmp_path):
    bm = flexjax.create_block_mask(flexjax.and_masks(masks.causal, masks.sliding_window(40)), None, None, 256, 256,
                                   block_size=32)
    fig = plot_block_mask(bm)
    assert len(fig.axes) == 2
    _png_ok(fig, tmp_path / "small.png")


def test_plot_large_mask_tiles_only(tmp_path):
    bm = flexjax.create_block_mask(masks.causal, None, None, 2048, 2048)
    fig = plot_block_mask(bm)
    assert len(fig.axes) == 1
    _png_ok(fig, tmp_path / "large.png")


def test_plot_into_given_axes_and_heads(tmp_path):
    import matplotlib.pyplot as plt

    def head_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx) < 32 * (h + 1))

    bm = flexjax.create_block_mask(head_mask, None, 2, 128, 128, block_size=16)
    fig, axes = plt.subplots(1, 2)
    assert plot_block_mask(bm, h=1, ax=axes, element=True) is fig
    _png_ok(fig, tmp_path / "axes.png")
    with pytest.raises(IndexError, match="h=5"):
        plot_block_mask(bm, h=5)


def test_element_mask_matches_create_mask():
    mod = masks.prefix_lm(20)
    bm = flexjax.create_block_mask(mod, None, None, 100, 90, block_size=32)
    want = np.asarray(flexjax.create_mask(mod, None, None, 100, 90))[0, 0]
    np.testing.assert_array_equal(element_mask(bm), want)


def test_missing_matplotlib_message(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    bm = flexjax.create_block_mask(masks.causal, None, None, 64, 64, block_size=32)
    with pytest.raises(ImportError, match=r"pip install flexjax\[notebooks\]"):
        plot_block_mask(bm)
