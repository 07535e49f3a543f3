"""Inside shard_map: the tp all-reduce (`reduce_tp`) and its transpose (`vary_tp`), the ordering
barrier `tie`, FSDP weight reads, the shard_map boundary (`shard`) and `global_norm`. The jax
internals used: docs/architecture.md, 'jax internals and the pins they need'.

    y = reduce_tp(partial_sum); pending, y = tie(pending, y)"""

from __future__ import annotations

from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax._src.lax.parallel import _psum_invariant_abstract_eval as _psum_typing
from jax._src.lax.parallel import _pvary_abstract_eval as _pvary_typing
from jax.interpreters import ad, batching, mlir
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ladder_jax.model.layout import DATA, TP

# ---------------------------------------------------------------------------------------------
# Collectives of the tensor-parallel forward: every module output is reduced by `reduce_tp`, and
# `tie` orders it in the ladder. (FSDP gathers are `read_weight` / `embed_lookup` below; the
# gradient norm is `global_norm`.)


def reduce_tp(partial_sum: jax.Array) -> jax.Array:
    """All-reduce a module's row-parallel output over `tp` (issued here, consumed later).

    A tp axis of one device has nothing to add: the partial sum is the sum, so it passes
    through unchanged (typed tp-invariant, as psum's result is: `sum_of_one`). XLA keeps a
    psum over one device as an all-reduce, which XLA:CPU runs as a copy and a rendezvous: 33 of
    them (2 MB each) in the `small` preset's training step at tp=1."""
    if jax.lax.axis_size(TP) == 1:
        return sum_of_one(partial_sum, TP)
    return jax.lax.psum(partial_sum, TP)


def vary_tp(x: jax.Array) -> jax.Array:
    """`x` (tp-invariant: the residual stream) cast to tp-varying, as a module's input is before
    it meets the rank's weights; the transpose of that cast is the all-reduce of the input's
    cotangent (autodiff issues it). At tp=1 the cast is `vary_of_one`, whose transpose adds
    nothing either: no all-reduce in the backward."""
    if jax.lax.axis_size(TP) == 1:
        return _vary_of_one_p.bind(x, axes=(TP,))
    return jax.lax.pcast(x, TP, to="varying")


def _vary_over_one_data_rank(w: jax.Array) -> jax.Array:
    """A weight read inside shard_map, replicated over a `data` axis of one device: cast to
    data-varying here, as jax would cast it where it meets the rank's batch rows, but with a
    transpose that adds nothing. jax's cast transposes to an all-reduce of the weight's
    gradient over `data`, which over one device XLA:CPU runs as a copy of every gradient per
    step. With more data ranks jax's cast stays, and its real gradient all-reduce."""
    if DATA in jax.typeof(w).manual_axis_type.varying or jax.lax.axis_size(DATA) != 1:
        return w
    return _vary_of_one_p.bind(w, axes=(DATA,))


# psum and its transpose (pvary) over an axis of size 1, without a collective: the same type
# rules as jax's (varying over the axis in, invariant out; and back), each the other's
# transpose, lowered to nothing. They reach into jax's own typing rules of the pinned jax
# version (`_psum_invariant_abstract_eval`, `_pvary_abstract_eval`), so the types cannot
# disagree with psum's.

_sum_of_one_p = jax.extend.core.Primitive("ladder_sum_of_one")
_vary_of_one_p = jax.extend.core.Primitive("ladder_vary_of_one")
for _p in (_sum_of_one_p, _vary_of_one_p):
    _p.def_impl(lambda x, *, axes: x)
    mlir.register_lowering(_p, lambda ctx, x, *, axes: [x])
    batching.primitive_batchers[_p] = lambda args, dims, *, axes, _p=_p: (
        _p.bind(args[0], axes=axes),
        dims[0],
    )
_sum_of_one_p.def_effectful_abstract_eval(
    lambda aval, *, axes: _psum_typing(_sum_of_one_p.name, aval, axes=axes)
)
_vary_of_one_p.def_abstract_eval(_pvary_typing)
ad.deflinear2(_sum_of_one_p, lambda ct, x, *, axes: (_vary_of_one_p.bind(ct, axes=axes),))
ad.deflinear2(_vary_of_one_p, lambda ct, x, *, axes: (_sum_of_one_p.bind(ct, axes=axes),))


def sum_of_one(x: jax.Array, axis: str) -> jax.Array:
    """`jax.lax.psum(x, axis)` for an `axis` of size 1 (checked), with no collective."""
    if jax.lax.axis_size(axis) != 1:
        raise ValueError(f"sum_of_one over axis {axis!r} of size {jax.lax.axis_size(axis)}")
    if axis not in jax.typeof(x).manual_axis_type.varying:
        return x  # psum of an invariant value over one device: x itself
    return _sum_of_one_p.bind(x, axes=(axis,))


# ---------------------------------------------------------------------------------------------
# `tie`: an optimization barrier that keeps each operand's type.
#
# jax.lax.optimization_barrier joins the varying-manual-axes (vma) types of its operands, so
# tying an all-reduced (tp-invariant) value to a partial sum (tp-varying) would make the
# residual stream varying from there on. `tie` lowers to the same XLA optimization barrier
# but gives every output exactly its input's type: sound, since the barrier is an identity.
# Its transpose is a tie of the cotangents.

_tie_p = jax.extend.core.Primitive("ladder_tie")
_tie_p.multiple_results = True
_tie_p.def_impl(lambda *xs: xs)
_tie_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(
    _tie_p, mlir.lower_fun(lambda *xs: jax.lax.optimization_barrier(xs), multiple_results=True)
)


def _tie_jvp(primals, tangents):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return _tie_p.bind(*primals), _tie_p.bind(*tangents)


def _tie_transpose(cts, *primals):
    return _tie_p.bind(*[ad.instantiate_zeros(c) for c in cts])


ad.primitive_jvps[_tie_p] = _tie_jvp
ad.primitive_transposes[_tie_p] = _tie_transpose
batching.primitive_batchers[_tie_p] = lambda args, dims, **_: (_tie_p.bind(*args), dims)


def tie(*xs):
    """Identity on `xs` that XLA must compute as one value: no consumer of any output can be
    scheduled before every input is ready. Keeps each operand's vma type."""
    return tuple(_tie_p.bind(*xs))


def shard(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """The one shard_map boundary of the model (check_vma stays on)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def global_norm(tree, shardings) -> jax.Array:
    """The L2 norm of all arrays in `tree`, laid out as `shardings` (one NamedSharding per leaf,
    all on one mesh: where each array is stored, e.g. the FSDP layout, so that nothing moves),
    with ONE scalar all-reduce over the whole mesh: each rank sums the squares of its own
    blocks, counting a block that is replicated over some mesh axes only on the ranks at index
    0 of those axes, and one psum adds the ranks' sums. Left to XLA, every sharded leaf would be
    reduced on its own: one small synchronous all-reduce per weight (the all-reduce combiner is
    off, see `compiler_options`)."""

    leaves = jax.tree.leaves(tree)
    sharding_leaves = jax.tree.leaves(shardings)
    mesh = sharding_leaves[0].mesh
    spec_leaves = [s.spec for s in sharding_leaves]
    axes = tuple(mesh.axis_names)

    def split_over(spec) -> set:
        out = set()
        for entry in spec:
            out.update(entry if isinstance(entry, tuple) else (entry,))
        return out

    def local(*blocks):
        total = jnp.zeros((), jnp.float32)
        for block, spec in zip(blocks, spec_leaves):
            sq = jnp.sum(jnp.square(block.astype(jnp.float32)))
            owner = [jax.lax.axis_index(a) == 0 for a in axes if a not in split_over(spec)]
            for first in owner:
                sq = jnp.where(first, sq, 0.0)
            total = total + sq
        return jnp.sqrt(jax.lax.psum(total, axes))

    return shard(local, mesh, in_specs=tuple(spec_leaves), out_specs=P())(*leaves)


def read_weight(weight, dtype=None) -> jax.Array:
    """Inside shard_map: this rank's tp block of `weight` (an nnx Param of the model), cast to
    `dtype` if given. A weight stored split over `data` too (FSDP: its `stored` spec, see
    `WeightSpecs.fsdp`) is cast first, then all-gathered over `data` here, where it is used:
    gathered in the compute dtype (half the bytes of fp32 weights) and, under
    `model.remat=module`, gathered again for the backward instead of kept. The gather's
    transpose reduce-scatters the weight's gradient over `data`, in that dtype too."""
    w = weight[...]
    if dtype is not None:
        w = w.astype(dtype)
    stored = getattr(weight, "stored", None)
    split = (
        []
        if stored is None
        else [
            i
            for i, entry in enumerate(stored)
            if DATA in (entry if isinstance(entry, tuple) else (entry,))
        ]
    )
    if not split:
        return _vary_over_one_data_rank(w)
    return jax.lax.all_gather(w, DATA, axis=split[0], tiled=True)


def embed_lookup(embed, tokens_bt) -> jax.Array:
    """Inside shard_map: the rows (B, T, D) of the embedding table `embed` (an nnx Param, tp
    layout (V, D) replicated) for this rank's tokens. A table stored split over `data` along V
    (FSDP) is not gathered (V x D is the largest weight of a Llama): the data ranks' tokens are
    all-gathered instead, each rank looks up those that fall in its V / data rows (zeros for
    the others), and a reduce-scatter over `data` sums and returns each rank its own batch rows.
    The backward all-gathers the rows' cotangent and adds it into the rank's own table rows."""
    stored = getattr(embed, "stored", None)
    table_vd = embed[...]
    if stored is None or tuple(stored)[:1] != (DATA,):
        return jnp.take(read_weight(embed), tokens_bt, axis=0)
    v_local = table_vd.shape[0]
    tokens_all = jax.lax.all_gather(tokens_bt, DATA, axis=0, tiled=True)
    local = tokens_all - jax.lax.axis_index(DATA) * v_local
    mine = (local >= 0) & (local < v_local)
    rows_btd = jnp.take(table_vd, jnp.where(mine, local, 0), axis=0)
    rows_btd = jnp.where(mine[..., None], rows_btd, 0).astype(table_vd.dtype)
    return jax.lax.psum_scatter(rows_btd, DATA, scatter_dimension=0, tiled=True)


def varies_over(x: jax.Array, axis: str) -> bool:
    """Inside shard_map: whether `x`'s type says it may differ across `axis` (its vma)."""
    return axis in jax.typeof(x).manual_axis_type.varying


def axis_index_tp() -> jax.Array:
    return jax.lax.axis_index(TP)


def local_kv_head(w_dkh: jax.Array, n_kv_heads: int, tp: int) -> jax.Array:
    """With replicated kv weights (K < tp), the (D, 1, H) slice this rank's query heads use.

    Rank r holds query heads [r*N/tp, (r+1)*N/tp); they all belong to kv head r // (tp/K).
    """
    head = axis_index_tp() // (tp // n_kv_heads)
    return jax.lax.dynamic_slice_in_dim(w_dkh, head, 1, axis=1)


def local_vocab_rows(embed_vd: jax.Array, tp: int) -> jax.Array:
    """This rank's V/tp rows of a replicated (V, D) table (tied LM head)."""
    v_local = embed_vd.shape[0] // tp
    return jax.lax.dynamic_slice_in_dim(embed_vd, axis_index_tp() * v_local, v_local, axis=0)


def vary_like(x, like):
    """`x` typed as varying over the manual mesh axes `like` varies over (inside shard_map a
    kernel's or a loop's result must carry its inputs' varying axes); `x` as it is outside
    shard_map or where jax's types have no manual axes."""
    try:
        want = jax.typeof(like).manual_axis_type.varying
        have = jax.typeof(x).manual_axis_type.varying
    except AttributeError:
        return x
    missing = tuple(a for a in want if a not in have)
    return jax.lax.pcast(x, missing, to="varying") if missing else x
