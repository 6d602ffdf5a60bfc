"""Matplotlib pictures of a BlockMask: tile states and, for short sequences, the element mask."""

from __future__ import annotations

import os
import sys

# Tile colours: empty, partial (mask_mod applied), full (no mask_mod needed).
_COLORS = ("#f2f2f2", "#f4a259", "#3b6ea8")
_LABELS = ("empty (skipped)", "partial (mask_mod applied)", "full (no mask_mod)")
_ELEMENT_COLORS = ("#f2f2f2", "#2a2a2a")


def _pyplot():
    """matplotlib.pyplot, choosing the Agg backend where there is no display."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "BlockMask plotting needs matplotlib, which is not installed; "
            "install it with `pip install flexjax[notebooks]` (or `pip install matplotlib`)"
        ) from e
    headless = not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) and sys.platform.startswith("linux")
    if headless and "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND"):
        # No display and nobody chose a backend (Jupyter sets MPLBACKEND): draw off-screen.
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def element_mask(block_mask, b: int = 0, h: int = 0, mask_mod=None):
    """bool (Q_LEN, KV_LEN): where ``mask_mod`` (default the BlockMask's) attends, as numpy."""
    import jax.numpy as jnp
    import numpy as np

    q_len, kv_len = block_mask.seq_lengths
    mod = block_mask.mask_mod if mask_mod is None else mask_mod
    q = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    kv = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    m = mod(jnp.int32(b), jnp.int32(h), q, kv)
    return np.broadcast_to(np.asarray(m, dtype=bool), (q_len, kv_len))


def _pick(n: int, i: int, axis: str) -> int:
    if n == 1:
        return 0  # the BlockMask broadcasts over this axis
    if not 0 <= i < n:
        raise IndexError(f"{axis}={i} is out of range for a BlockMask with {n} {axis} entries")
    return i


def plot_block_mask(block_mask, b: int = 0, h: int = 0, ax=None, *, element: bool | None = None,
                    mask_mod=None, max_element_seq: int = 512, title: str | None = None, legend: bool = True):
    """Draws the tiles of ``block_mask`` (empty / partial / full) and, optionally, its mask.

    Args:
      block_mask: a BlockMask.
      b, h: the batch and head to draw (ignored on an axis the mask broadcasts over).
      ax: a matplotlib Axes for the tile picture, or a pair of Axes (tiles, elements);
        None makes a new figure.
      element: also draw the element-level mask beside the tiles. None (default) does so
        when both sequence lengths are at most ``max_element_seq``.
      mask_mod: the mask_mod for the element picture; default the BlockMask's own.
      max_element_seq: the largest length drawn element by element when ``element=None``.
      title: a title for the tile picture; default the mask_mod's name and sparsity.
      legend: draw the colour legends (turn off for all but one panel of a grid).

    Returns:
      The matplotlib Figure.

    Raises:
      ImportError: matplotlib is missing (``pip install flexjax[notebooks]``).
    """
    import numpy as np

    plt = _pyplot()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    B, H = block_mask.kv_num_blocks.shape[:2]
    nq, nkv = block_mask.num_blocks
    bi, hi = _pick(B, b, "b"), _pick(H, h, "h")
    tiles = block_mask.tile_states(bi, hi)
    q_len, kv_len = block_mask.seq_lengths
    bq, bkv = block_mask.block_size
    if element is None:
        element = max(q_len, kv_len) <= max_element_seq

    if ax is None:
        ncols = 2 if element else 1
        fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 4.6), squeeze=False)
        axes = list(axes[0])
    else:
        axes = list(ax) if isinstance(ax, (list, tuple, np.ndarray)) else [ax]
        if element and len(axes) < 2:
            raise ValueError("element=True needs a pair of Axes (tiles, elements); pass ax=(ax1, ax2)")
        fig = axes[0].figure

    name = block_mask.mask.name if block_mask.mask is not None else "noop_mask"
    empty = float((tiles == 0).mean()) * 100
    # Tiles are drawn in token coordinates so the two pictures line up.
    extent = (0, nkv * bkv, nq * bq, 0)
    cmap = ListedColormap(list(_COLORS))
    tile_ax = axes[0]
    tile_ax.imshow(tiles, cmap=cmap, norm=BoundaryNorm([-0.5, 0.5, 1.5, 2.5], 3), extent=extent,
                   interpolation="nearest", aspect="auto")
    if nq <= 64 and nkv <= 64:
        tile_ax.set_xticks(np.arange(0, nkv * bkv + 1, bkv), minor=True)
        tile_ax.set_yticks(np.arange(0, nq * bq + 1, bq), minor=True)
        tile_ax.grid(which="minor", color="white", linewidth=0.6)
        tile_ax.tick_params(which="minor", length=0)
    tile_ax.set_xlabel(f"kv index (blocks of {bkv})")
    tile_ax.set_ylabel(f"q index (blocks of {bq})")
    tile_ax.set_title(title or f"{name}\n{nq}x{nkv} tiles, {empty:.1f}% skipped", fontsize=10)
    if legend:
        handles = [Patch(facecolor=c, edgecolor="0.6", label=lab)
                   for c, lab in zip(_COLORS, _LABELS, strict=True)]
        tile_ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, fontsize=8,
                       frameon=False)

    if element:
        m = element_mask(block_mask, bi, hi, mask_mod)
        el_ax = axes[1]
        el_ax.imshow(m, cmap=ListedColormap(list(_ELEMENT_COLORS)), vmin=0, vmax=1, extent=(0, kv_len, q_len, 0),
                     interpolation="nearest", aspect="auto")
        el_ax.set_xlim(0, nkv * bkv)
        el_ax.set_ylim(nq * bq, 0)
        el_ax.set_xlabel("kv index")
        el_ax.set_ylabel("q index")
        el_ax.set_title(f"element mask ({m.mean() * 100:.1f}% of pairs attend)", fontsize=10)
        if legend:
            el_ax.legend(handles=[Patch(facecolor=_ELEMENT_COLORS[1], label="attend"),
                                  Patch(facecolor=_ELEMENT_COLORS[0], edgecolor="0.6", label="masked")],
                         loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    if ax is None:
        fig.tight_layout()
    return fig
