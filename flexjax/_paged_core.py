"""The paged forward's core, shared by ``flexjax.paged`` and its ragged calls: the page table's
checks, the logical cache a pool stands for, token writes, and the autodiff of a call."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import _quant
from ._factory import fail_on_host, int_array
from .backends import available_backends, get_backend, options_tuple


def serves_paged(impl) -> bool:
    """Whether backend module ``impl`` declares a paged path (``_contract.PagedBackend``)."""
    from .backends._contract import PagedBackend

    return isinstance(impl, PagedBackend)


def check_backend(caller: str, backend, kernel_options) -> None:
    """A named backend must have a paged path; kernel_options keys must be some backend's (the chooser then
    takes only the backends that take them)."""
    # Only a named backend's module is imported here: a call with backend=None asks just the backends of
    # its platform (the chooser), so a CPU call never imports the GPU and TPU kernels.
    if backend is not None and (backend not in available_backends() or not serves_paged(get_backend(backend))):
        paged_backends = tuple(n for n in available_backends() if serves_paged(get_backend(n)))
        raise NotImplementedError(f"{caller} has paths on the {', '.join(paged_backends)} backends; got "
                                  f"backend={backend!r}: pass backend=None or one of {paged_backends}")
    options_tuple(kernel_options, backend)


class _Chosen(Exception):
    """Raised by ``choose_paged`` under ``explaining()``: the plan a paged call would run, before it runs."""

    def __init__(self, plan, skipped: list):
        super().__init__(plan.backend)
        self.plan, self.skipped = plan, skipped


_EXPLAINING = contextvars.ContextVar("flexjax_paged_explaining", default=False)


@contextlib.contextmanager
def explaining():
    """Within it, a paged call stops at its backend choice, raising ``_Chosen``."""
    token = _EXPLAINING.set(True)
    try:
        yield
    finally:
        _EXPLAINING.reset(token)


NO_PAGED_PATH = "no paged path"


def choose_paged(caller: str, backend, plan_of, *, warn: bool = True) -> tuple:
    """The named backend's plan, or the first plan of the platform's backends (``backends.platform_backends``)
    with a paged path, and (name, reason) for each passed over: the dense chooser's walker and rule
    (``_contract.choose``: an invalid option value raises; a skipped backend warns; a named one that
    cannot serve raises). ``plan_of(name)``: backend ``name``'s ``Plan`` for the call, or why it cannot
    serve it."""
    from .backends import current_platform, platform_backends
    from .backends._contract import Implementation, choose

    names = (backend,) if backend is not None else platform_backends()
    candidates = [Implementation(n, (lambda n=n, **_: plan_of(n)) if serves_paged(get_backend(n))
                                 else (lambda **_: NO_PAGED_PATH)) for n in names]
    name, plan, skipped = choose(candidates, f"{caller} backend choice", or_none=True)
    if name is None and backend is not None:
        raise NotImplementedError(f"backend {backend!r} cannot serve this {caller} call: {skipped[0][1]}")
    if name is None:
        raise NotImplementedError(f"no backend can serve this {caller} call on {current_platform()}: "
                                  + "; ".join(f"{n}: {r}" for n, r in skipped))
    if _EXPLAINING.get():
        raise _Chosen(plan, skipped)
    # (A backend with no paged path is not a candidate: it is listed for explain, not warned about.)
    for other, why in [(n, r) for n, r in skipped if r != NO_PAGED_PATH] if warn else ():
        warnings.warn(f"flexjax: backend {other!r} cannot serve this {caller} call ({why}); using {name!r}. "
                      f"Pass backend={name!r} to choose it explicitly.", stacklevel=4)
    return plan, skipped


def paged_plan(name: str, spec, q, k_pages, v_pages, score_consts, mask_consts, lists, scales):
    """Backend ``name``'s ``Plan`` for a paged call, or why it cannot serve it: kernel_options it does not
    take, its options' checks (a ValueError raises), its ``resolve`` (the options, once, for a logical
    cache of the pools' shape and, for quantized pools, the query's dtype), its ``supports_paged`` and
    ``supports_quantized``, then its ``PAGED_FORWARD`` implementation. The backward of every paged call is
    ``backends/_paged_backward.py``'s."""
    from .backends import kernel_option_names
    from .backends._contract import Plan, answer, validate, walk

    impl = get_backend(name)
    unknown = sorted(set(spec.options) - set(kernel_option_names(name)))
    if unknown:
        return f"it takes no kernel_options {unknown}"
    validate(impl, spec)
    who = f"the {name} backend"
    like = _logical_like(q.shape[0], spec.kv_len, k_pages, v_pages, q.dtype if scales is not None else None)
    options = answer(impl.resolve, who, spec, q, *like)
    if isinstance(options, str):
        return options
    reason = answer(impl.supports_paged, who, spec, q, *like, lists, options)
    if reason is None and scales is not None:
        reason = answer(impl.supports_quantized, who, spec, q, k_pages, options)
    if reason is not None:
        return reason
    k_like, v_like = _logical_like(q.shape[0], spec.kv_len, k_pages, v_pages)
    forward, fallback, skipped = walk(impl, "PAGED_FORWARD", dict(
        spec=spec, q=q, k=k_like, v=v_like, score_consts=score_consts, mask_consts=mask_consts, lists=lists,
        dropout_seed=None, options=options))
    return Plan(name, forward, "paged_backward", "paged_backward", options, fallback,
                skipped_forward=tuple(skipped))


def check_pages(caller: str, page_table, kv_lengths, num_pages: int, page_size: int,
                lengths_name="kv_lengths") -> jax.Array:
    """The page table and lengths of a paged read can be right: every entry below ``num_pages`` (negative:
    unassigned), every length in ``[0, max_pages * page_size]``, and every page a length reaches assigned.
    A ValueError naming the argument, the sequence and the fix: eagerly, or when a jitted step runs. Returns
    ``fail_on_host``'s 0, for the caller to add into the lengths it reads."""
    max_pages = page_table.shape[1]
    capacity = max_pages * page_size
    reached = jnp.arange(max_pages, dtype=jnp.int32)[None, :] * page_size < kv_lengths[:, None]
    ok = (jnp.all(page_table < num_pages) & jnp.all((kv_lengths >= 0) & (kv_lengths <= capacity))
          & jnp.all(~reached | (page_table >= 0)))

    def fail(table, lengths):
        table, lengths = np.asarray(table), np.asarray(lengths)
        rows, cols = np.nonzero(table >= num_pages)
        if rows.size:
            b, j = int(rows[0]), int(cols[0])
            raise ValueError(
                f"{caller}: page_table[{b}, {j}] = {int(table[b, j])} is past the pool's {num_pages} pages (sequence "
                f"{b}'s logical page {j}); entries must be physical pages 0..{num_pages - 1}, or -1 where unassigned "
                "(paged.reserve assigns them)")
        bad = np.nonzero((lengths < 0) | (lengths > capacity))[0]
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"{caller}: {lengths_name}[{b}] = {int(lengths[b])} but the page table holds {capacity} tokens a "
                f"sequence (max_pages {max_pages} x page_size {page_size}); pass lengths in [0, {capacity}] or a "
                "wider page table")
        for b in range(table.shape[0]):
            need = -(-int(lengths[b]) // page_size)
            holes = np.nonzero(table[b, :need] < 0)[0]
            if holes.size:
                j = int(holes[0])
                raise ValueError(
                    f"{caller}: sequence {b} has {lengths_name}[{b}] = {int(lengths[b])} tokens, which reach its "
                    f"logical page {j}, but page_table[{b}, {j}] = {int(table[b, j])} is unassigned; assign the "
                    f"pages first (paged.reserve(page_table, free_pages, {lengths_name}, {page_size})) or pass "
                    "the sequence's true length")
        raise ValueError(f"{caller}: page_table / {lengths_name} cannot be right")  # unreachable: ok was False

    return fail_on_host(ok, fail, page_table, kv_lengths)


def _page_table(page_table, B: int | None = None) -> jax.Array:
    pt = int_array("page_table", page_table, "(B, max_pages)")
    if pt.ndim != 2 or (B is not None and pt.shape[0] != B):
        raise ValueError(f"page_table must be int32 (B{'' if B is None else f'={B}'}, max_pages), got shape "
                         f"{pt.shape}")
    return pt


def _write_slots(k_pages, v_pages, page, slot, k_new, v_new, k_scale, v_scale, runs: int | None = None,
                 seq=None, tail=None, batch: int | None = None):
    """Tokens (N, Hkv, .) into (page[n], slot[n]) (a page past the pool drops the token);
    ``runs``: the tokens are at most that many sequences of consecutive positions (see
    ``_quant.write_quantized``); ``seq``: each token's sequence (of ``batch``), for a ``FloatTail``."""
    scales = _quant.check_scales(k_pages, v_pages, k_scale, v_scale)
    if scales is None:
        if tail is not None:
            raise ValueError("tail is for int8 / float8_e4m3fn pools with per-(page, head) scales; these pools "
                             f"are {k_pages.dtype}: pass no tail")
        return (k_pages.at[page, slot].set(k_new.astype(k_pages.dtype), mode="drop"),
                v_pages.at[page, slot].set(v_new.astype(v_pages.dtype), mode="drop"))
    # Per-head scales stay as given (their shape too); per-page ones may grow.
    ks = k_scale if jnp.ndim(k_scale) == 1 else scales[0]
    vs = v_scale if jnp.ndim(v_scale) == 1 else scales[1]
    if tail is None:
        k_pages, ks, _ = _quant.write_quantized(k_pages, ks, page, slot, k_new, runs)
        v_pages, vs, _ = _quant.write_quantized(v_pages, vs, page, slot, v_new, runs)
        return k_pages, v_pages, ks, vs
    tail = check_tail(tail, k_pages, v_pages, k_scale, v_scale, batch)
    k_pages, ks, (tk, tpk) = _quant.write_quantized(k_pages, ks, page, slot, k_new, runs, seq, (tail.k, tail.page))
    v_pages, vs, (tv, tpv) = _quant.write_quantized(v_pages, vs, page, slot, v_new, runs, seq, (tail.v, tail.page))
    # (The two pools' pages are quantized from their values together: a row keeps its page only where both did.)
    return k_pages, v_pages, ks, vs, _quant.FloatTail(tk, tv, jnp.where(tpk == tpv, tpk, -1))


def check_tail(tail, k_pages, v_pages, k_scale, v_scale, batch: int | None = None) -> _quant.FloatTail:
    """``tail`` as a FloatTail of these pools (``paged.float_tail``), for per-(page, head) scales."""
    if not isinstance(tail, tuple) or len(tail) != 3:
        raise TypeError(f"tail must be a paged.FloatTail (paged.float_tail(batch, k_pages, v_pages)), got "
                        f"{type(tail).__name__}")
    if jnp.ndim(k_scale) != 2 or jnp.ndim(v_scale) != 2:
        raise ValueError("tail goes with per-(page, head) scales, float32 (num_pages, Hkv); per-head scales are "
                         "fixed and need none: pass no tail")
    k, v, pg = (jnp.asarray(x) for x in tail)
    B = pg.shape[0] if pg.ndim == 1 else None
    want_k = (B, *k_pages.shape[1:])
    want_v = (B, *v_pages.shape[1:])
    if (B is None or (batch is not None and B != batch) or k.shape != want_k or v.shape != want_v
            or k.dtype != jnp.float32 or v.dtype != jnp.float32 or not jnp.issubdtype(pg.dtype, jnp.integer)):
        raise ValueError(f"tail must be paged.float_tail(batch{'' if batch is None else f'={batch}'}, k_pages, "
                         f"v_pages): float32 k {want_k}, v {want_v} and int32 page (batch,), got k "
                         f"{k.dtype}{k.shape}, v {v.dtype}{v.shape}, page {pg.dtype}{pg.shape}")
    return _quant.FloatTail(k, v, pg.astype(jnp.int32))


def gather(pages, page_table, scale=None) -> jax.Array:
    """The contiguous logical cache (B, max_pages * page_size, kv_heads, .) of a pool (for
    tests); a quantized pool with its ``scale`` comes back dequantized, float32."""
    B, mp = page_table.shape
    x = pages[page_table]
    if scale is not None:
        s = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (pages.shape[0], pages.shape[2]))
        x = x.astype(jnp.float32) * s[page_table][:, :, None, :, None]
    return x.reshape(B, mp * pages.shape[1], *pages.shape[2:])


def _logical_like(B: int, kv_len: int, k_pages, v_pages, dtype=None):
    """Shapes of the contiguous (B, kv_len, Hkv, D) cache the pools stand for (for the
    backends' checks); ``dtype``: a quantized pool's, the dtype it is dequantized to."""
    return tuple(jax.ShapeDtypeStruct((B, kv_len) + x.shape[2:], dtype or x.dtype) for x in (k_pages, v_pages))


def _paged_forward(plan, spec, q, k_pages, v_pages, score_consts, mask_consts, lists, extra):
    page_table, scales = extra
    return get_backend(plan.backend).paged_forward(spec, q, k_pages, v_pages, page_table, score_consts, mask_consts,
                                                   lists, scales, plan=plan)


# Autodiff as flex_attention's: a custom_jvp whose tangent goes through ``linear_apply``, a
# linear map whose transpose is the backward. The backward reads the pools through the page
# table (``backends._paged_backward``, one XLA loop for every backend, no logical cache); the
# tangent pass (``jax.jvp``: the xla backend's blockwise pass) runs on the logical cache
# gathered through the table. ``jax.grad`` runs only the backward.

@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _paged(plan, spec, q, k_pages, v_pages, score_consts, mask_consts, lists, extra):
    """``plan``: ``paged_plan``'s; ``extra``: (page_table, scales), scales None or a quantized pool's
    (k_scale, v_scale)."""
    out, lse, residuals = _paged_forward(plan, spec, q, k_pages, v_pages, score_consts, mask_consts, lists, extra)
    row_max = residuals.row_max  # max_scores, as flex_attention's
    return out, lse, row_max


def _paged_jvp(plan, spec, primals, tangents):
    from ._autodiff import attention_jvp

    def forward(q, k_pages, v_pages, score_consts, mask_consts, lists, extra):
        return _paged_forward(plan, spec, q, k_pages, v_pages, score_consts, mask_consts, lists, extra)

    def scatter(d, pages, extra):
        d = d.reshape(d.shape[0], -1, pages.shape[1], *d.shape[2:])
        return jnp.zeros(pages.shape, d.dtype).at[extra[0]].add(d)

    def logical(which):
        def f(pages, extra):
            page_table, scales = extra
            if scales is None:
                return gather(pages, page_table)
            # A quantized pool: dequantized (its pages get no gradient: integer tangents).
            return gather(pages, page_table, scales[which]).astype(primals[0].dtype)
        return f

    def backward(spec, q, k_pages, v_pages, out, lse, dout, dlse, sc, mc, lists, grad_consts, extra):
        # Gather-free: the pools are read (and their gradients added) through the table.
        from .backends._paged_backward import paged_backward

        page_table, scales = extra
        return paged_backward(spec, q, k_pages, v_pages, page_table, out, lse, dout, dlse, sc, mc, lists, grad_consts,
                              scales)

    return attention_jvp(plan, spec, primals, tangents, forward, logical=logical(0),
                         logical_v=logical(1), from_logical=scatter, backward=backward)


_paged.defjvp(_paged_jvp, symbolic_zeros=True)
