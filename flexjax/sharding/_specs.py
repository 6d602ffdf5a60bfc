"""attention_specs: the active sharding of q and k/v, its checks, and the mesh it names."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import PartitionSpec as P

_DIMS = ("batch", "seq", "heads", "head_dim")

# A jit-cache-sensitive context: a function traced under other specs (or none) is traced
# again rather than reused.
_ACTIVE = jax.make_user_context(default_value=None)


def _entry(value, where: str):
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)) and value and all(isinstance(a, str) for a in value):
        return value[0] if len(value) == 1 else tuple(value)
    raise TypeError(
        f"{where} must be None, a mesh axis name or a tuple of axis names, got {value!r}")


def _spec(specs, name: str) -> tuple:
    if isinstance(specs, P):
        specs = tuple(specs)
    if not isinstance(specs, (tuple, list)) or len(specs) != 4:
        raise ValueError(
            f"{name} must give one entry per axis of (batch, seq, heads, head_dim), e.g. "
            f"('data', 'context', None, None); got {specs!r}")
    entries = tuple(_entry(e, f"{name}[{i}] ({_DIMS[i]})") for i, e in enumerate(specs))
    used = [a for e in entries for a in axes_of(e)]
    if len(used) != len(set(used)):
        raise ValueError(f"{name} {specs!r} names a mesh axis twice; each axis can shard one dimension")
    return entries


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one spec entry, major first."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class AttentionSpecs:
    """How flex_attention's operands are laid out over the mesh.

    Attributes:
      query: entries for (batch, seq, heads, head_dim) of q and of the output.
      kv: the same for k and v.
      permuted: whether the sequence axis is in ``permute_tokens`` order.
      mesh: the mesh the axes belong to (abstract when read off the arrays' sharding
        types), or None to use the one set by ``jax.set_mesh``.
    """

    query: tuple
    kv: tuple
    permuted: bool = False
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None

    @property
    def strategy(self) -> str:
        """"ring" when k/v are sharded over the context axis, else "all_gather"."""
        return "ring" if self.kv[1] is not None else "all_gather"

    def resolve_mesh(self):
        """The mesh to shard over: the explicit one, else the ambient (abstract) mesh."""
        if self.mesh is not None:
            return self.mesh
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                "attention_specs names mesh axes but no mesh is active; wrap the call in "
                "`with jax.set_mesh(mesh):` or pass attention_specs(..., mesh=mesh)")
        return mesh

    def axis_sizes(self, mesh) -> dict[str, int]:
        """Mesh axis sizes, after checking that every axis the specs name exists."""
        sizes = dict(mesh.shape)
        for name, spec in (("query_specs", self.query), ("kv_specs", self.kv)):
            for entry in spec:
                for a in axes_of(entry):
                    if a not in sizes:
                        raise ValueError(
                            f"{name} names mesh axis {a!r}, but the mesh has axes {tuple(sizes)}")
        return sizes

    def context_shards(self, mesh=None) -> int:
        """n: the number of shards of the query's sequence axis."""
        sizes = self.axis_sizes(mesh if mesh is not None else self.resolve_mesh())
        return math.prod(sizes[a] for a in axes_of(self.query[1]))

    def names(self) -> tuple[str, ...]:
        """Every mesh axis the specs name."""
        return tuple(a for spec in (self.query, self.kv) for e in spec for a in axes_of(e))


def make_specs(query_specs: Sequence, kv_specs: Sequence, permuted: bool = False,
               mesh: jax.sharding.Mesh | None = None) -> AttentionSpecs:
    """Checks and normalizes the arguments of ``attention_specs``."""
    q = _spec(query_specs, "query_specs")
    kv = _spec(kv_specs, "kv_specs")
    if not isinstance(permuted, bool):
        raise TypeError(f"permuted must be a bool, got {type(permuted).__name__}")
    if q[0] != kv[0]:
        raise ValueError(
            f"query_specs shards batch as {q[0]!r} but kv_specs as {kv[0]!r}; q and k/v of one "
            "attention share their batch, so give both the same batch entry")
    if q[3] != kv[3]:
        raise ValueError(
            f"query_specs shards head_dim as {q[3]!r} but kv_specs as {kv[3]!r}; give both None")
    if q[3] is not None:
        raise ValueError(
            f"head_dim cannot be sharded (got {q[3]!r}): attention contracts over it; shard heads "
            "instead, e.g. query_specs=('data', 'context', 'model', None)")
    if kv[1] is not None and kv[1] != q[1]:
        raise ValueError(
            f"kv_specs shards the sequence over {kv[1]!r} but query_specs over {q[1]!r}; use None "
            "(k/v all-gathered over the context axis) or the query's entry (ring)")
    if kv[2] is not None and kv[2] != q[2]:
        raise ValueError(
            f"kv_specs shards heads over {kv[2]!r} but query_specs over {q[2]!r}; use the same entry "
            "(tensor parallelism), or None to keep k/v heads whole on every shard")
    seq_axes = set(axes_of(q[1]))
    for i in (0, 2):
        for spec in (q, kv):
            if seq_axes & set(axes_of(spec[i])):
                raise ValueError(
                    f"mesh axes {sorted(seq_axes)} shard the sequence and cannot also shard {_DIMS[i]}")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    return AttentionSpecs(q, kv, permuted, mesh)


@contextlib.contextmanager
def attention_specs(query_specs: Sequence, kv_specs: Sequence, permuted: bool = False, *,
                    mesh: jax.sharding.Mesh | None = None) -> Iterator[AttentionSpecs]:
    """Shards every ``flex_attention`` traced inside the block over the mesh.

    Entries are those of a ``PartitionSpec`` for the 4 axes ``(batch, seq, heads,
    head_dim)``: None, a mesh axis name, or a tuple of names. The query's ``seq`` entry
    is the context axis; ``kv_specs[1]`` picks the strategy:

    - None: k/v are all-gathered over the context axis (each shard holds all keys).
    - the query's entry: ring; k/v stay sharded and pass around the ring with ``ppermute``.

    Batch and head_dim entries must agree between q and kv (head_dim unsharded). Heads
    may be sharded (tensor parallelism); k/v heads then use the same entry or None.

    Args:
      query_specs: sharding of q and of the output.
      kv_specs: sharding of k and v.
      permuted: q, k, v and the output are in ``permute_tokens`` order (load balance for
        causal-like masks); mods and block masks keep speaking of original positions.
      mesh: the mesh, if not the one set with ``jax.set_mesh``.

    Yields:
      The checked AttentionSpecs.

    The specs are part of ``jax.jit``'s cache key: a function traced outside the block
    (or under other specs) is traced again inside it.
    """
    specs = make_specs(query_specs, kv_specs, permuted, mesh)
    with _ACTIVE(specs):
        yield specs


def active_specs() -> AttentionSpecs | None:
    """The innermost active ``attention_specs``, or None."""
    return _ACTIVE.value
