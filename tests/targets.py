"""The registry of test targets: every backend (and each of its templates that runs on a CPU host) as
one ``Target`` line with capability flags, which every capability file parametrizes through
(``params``). A new backend adds one line here; the files skip what its flags say it cannot do.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import jax.numpy as jnp
import pytest
from catalog import CATALOG, SHAPES


@dataclasses.dataclass(frozen=True)
class Target:
    """A backend as the suite runs it on a CPU host.

    Attributes:
      id: the test id.
      backend: the ``backend=`` name.
      options: kernel_options selecting the template (None: the host's default).
      dtype: the dtype of the suite's checks (float32; a 16-bit one for a backend that takes no float32).
      dtypes: the further 16-bit dtypes its catalog entries run in (``low_cases``).
      head_dim: the head dim (and value head dim) every check's shape takes, for a backend that takes only
        some (None: the shapes' own, 8 to 16).
      max_len: for a target whose interpreter is slow, the longest sequence (and batch 1) of the checks'
        shapes (None: the shapes' own, up to 250).
      tiles: kernel_options that split and regroup the BlockMask's blocks ({} where it takes no tiles).
      cases: the catalog entries of the default run (the whole catalog runs in its own files or slow).
      low_cases: the catalog entries run in each of ``dtypes``.
      shape: (B, Sq, Skv, Hq, Hkv, D, Dv) of the catalog tests (GQA, ragged lengths, Dv != D).
      captured_grads: gradients reach arrays the score_mod closes over, gathered in the kernel.
      needs: modules that must import (the target is skipped otherwise).
      marks: pytest marks of every test of this target.
      options_checked: ``validate_options`` refuses bad tile values (it takes kernel_options).
      gathers: its kernels read a captured array at (q_idx, kv_idx) (an in-kernel gather).
      dropout_kernel: it has its own dropout path (the reference's is dense).
      paged: it serves ``flexjax.paged`` calls (a ``PagedBackend``).
      training: it runs the training-feature checks (sinks, max_scores, JVP) of
        ``test_training_features.py``; ``training_cost``: "cheap" (make test), "interpreted"
        (make test-all) or "compiled" (under its marker, make test-compile).
    """

    id: str
    backend: str
    options: dict | None = None
    dtype: Any = jnp.float32
    dtypes: tuple = (jnp.bfloat16, jnp.float16)
    head_dim: int | None = None
    max_len: int | None = None
    tiles: dict = dataclasses.field(default_factory=dict)
    cases: tuple = ("causal+soft_cap", "sliding_window+alibi", "document+t5", "per_head_mask+relative_bias")
    low_cases: tuple = ("causal+soft_cap",)
    shape: tuple = SHAPES["gqa_unequal"]
    captured_grads: bool = True
    needs: tuple = ()
    marks: tuple = ()
    options_checked: bool = True
    gathers: bool = True
    dropout_kernel: bool = True
    paged: bool = True
    training: bool = False
    training_cost: str = "interpreted"

    def shape_of(self, shape: tuple) -> tuple:
        """(B, Sq, Skv, Hq, Hkv, D, Dv) with this target's head dim and longest sequence."""
        B, Sq, Skv, Hq, Hkv, D, Dv = shape
        if self.max_len is not None:
            B, Sq, Skv = 1, min(Sq, self.max_len), min(Skv, self.max_len)
        return (B, Sq, Skv, Hq, Hkv, *((D, Dv) if self.head_dim is None else (self.head_dim,) * 2))

    def inputs(self, shape: tuple, seed: int = 0):
        """q, k, v, dO of ``shape`` (with its head dim) in its dtype."""
        from catalog import inputs

        return inputs(self.shape_of(shape), self.dtype, seed)

    def kw(self, extra: dict | None = None) -> dict:
        options = {**(self.options or {}), **(extra or {})}
        return {"backend": self.backend, **({"kernel_options": options} if options else {})}


def _interpreter_bf16() -> tuple:
    """bfloat16 for the triton target where Triton's interpreter computes its dots right."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        return ()
    from flexjax.backends.triton import _launch

    return (jnp.bfloat16, jnp.float16) if _launch.interpreter_bf16_dot_ok() else (jnp.float16,)


TARGETS = (
    Target("reference", "reference", cases=("causal+soft_cap",), options_checked=False, dropout_kernel=False,
           paged=False),
    Target("xla", "xla", tiles={"split": None, "regroup": {"block_q": 128, "block_kv": 64, "bwd_block_q": 64,
                                                          "bwd_block_kv": 128}},
           cases=("causal+soft_cap", "sliding_window+alibi"),  # the whole catalog: test_xla.py
           training=True, training_cost="cheap"),
    Target("pallas", "pallas", dtypes=(jnp.bfloat16,),
           tiles={"split": {"block_q": 32, "block_kv": 16, "bwd_block_q": 16, "bwd_block_kv": 32},
                  "regroup": {"block_q": 128, "block_kv": 64, "bwd_block_q": 64, "bwd_block_kv": 128}},
           training=True),
    Target("pallas_tpu", "pallas", {"target": "tpu", "interpret": True}, dtypes=(),
           cases=("sliding_window+alibi",), gathers=False),  # Mosaic TPU: no in-kernel gather
    Target("triton", "triton", dtypes=(), needs=("triton", "torch"), marks=(pytest.mark.triton,),
           tiles={"split": {"block_q": 32, "block_kv": 16, "bwd_block_q": 16, "bwd_block_kv": 32},
                  "regroup": {"block_q": 128, "block_kv": 128, "bwd_block_q": 64, "bwd_block_kv": 128}},
           cases=tuple(c.name for c in CATALOG), low_cases=tuple(c.name for c in CATALOG),
           shape=(1, 130, 200, 4, 2, 16, 8),  # batch 1: the interpreter runs every tile op in NumPy
           training=True, training_cost="compiled"),
    # Mosaic GPU's interpreter (sm_90a's kernels): bfloat16 inputs, head dims of 64, sequences of at most
    # 80 (at the suite's 192 x 192, batch 2, one check took 120 s); its catalog in both 16-bit dtypes and
    # on both architectures: test_mosaic_gpu.py. Under its marker, make test-compile.
    Target("mosaic_gpu", "mosaic_gpu", dtype=jnp.bfloat16, dtypes=(), head_dim=64, max_len=80,
           marks=(pytest.mark.mosaic_gpu,), cases=("causal+soft_cap",), shape=(1, 70, 100, 4, 2, 64, 64),
           gathers=False, paged=False),
)
_BF16 = _interpreter_bf16()
TARGETS = tuple(dataclasses.replace(t, dtypes=_BF16) if t.id == "triton" else t for t in TARGETS)


def marks_of(t: Target) -> list:
    """The target's marks, and a skip naming the modules it needs that do not import here (or the package its
    backend says is missing)."""
    missing = [m for m in t.needs if importlib.util.find_spec(m) is None]
    if missing:
        return list(t.marks) + [pytest.mark.skip(reason=f"needs {', '.join(missing)}")]
    from flexjax.backends import get_backend

    absent = getattr(get_backend(t.backend), "MISSING", None)  # a package its kernels import (mosaic_gpu)
    return list(t.marks) + ([pytest.mark.skip(reason=absent)] if absent else [])


def params(select=lambda t: True, values=None, slow=lambda t: False, extra=lambda t: False):
    """pytest params over the targets ``select`` keeps, crossed with ``values`` when given;
    those ``slow`` picks run under ``make test-all`` (the default suite's time budget), those ``extra``
    picks under ``make test-extra`` (ci_extra)."""
    out = []
    for t in TARGETS:
        if not select(t):
            continue
        marks = marks_of(t) + ([pytest.mark.slow] if slow(t) else []) + ([pytest.mark.ci_extra] if extra(t) else [])
        for value, vid in (values(t) if values else [(None, None)]):
            args = (t,) if values is None else (t, value)
            out.append(pytest.param(*args, id=t.id if vid is None else f"{t.id}-{vid}", marks=marks))
    return out


def budgeted(select, default=(), extra=(), values=None, marked: bool = True):
    """``params`` over the targets ``select`` keeps, placed by a file's time budget: the ids in ``default``
    run in make test, those in ``extra`` in make test-extra, a marked target (triton, mosaic_gpu) under its
    marker (make test-compile; with ``marked=False`` in make test-all too), and every other in make
    test-all. A new target joins each such file through its flags, in make test-all (or under its marker)
    until a file names it."""
    return params(select, values, slow=lambda t: (marked is False or not t.marks) and t.id not in (*default, *extra),
                  extra=lambda t: t.id in extra)
