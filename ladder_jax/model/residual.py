"""The residual stream of every scheme: `run` wires the layers. For standard, ladder, hybrid and
upper_bound one wiring, the forward that follows it, and the ladder's hand-written backward
that walks it in reverse; parallel (`_parallel`), whose two modules share one input and one
all-reduce, beside them.

    slots = wiring(config)        # one Slot per module: immediate or deferred

A module is *immediate* (x = x + pending; y = module(norm(x))) or *deferred* (y =
module(norm(x)); x = x + pending), then pending = psum(y): a deferred module reads the stream
without the previous module's output, whose all-reduce is in flight meanwhile. Exactly one
reduced output is pending when a module starts. The backward (`_ladder_stream`) walks the same
wiring in reverse so that its all-reduces overlap too; it equals autodiff (tested against an
independent reference). `parallel` (`_parallel`) shares one input and one all-reduce per
layer. Decoding with the Triton matmul (`_decode_stream`) runs the same wiring with its norms
and additions folded into the matmul kernels. The derivation:
docs/architecture.md#the-residual-wiring.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ladder_jax.model import sharding
from ladder_jax.model.linear import Joins
from ladder_jax.model.sharding import DATA


@dataclasses.dataclass(frozen=True)
class Slot:
    """One module's place in the wiring."""

    layer: int
    name: str  # "attn" or "mlp"
    deferred: bool  # reads the stream before the previous module's output is added


def wiring(config) -> tuple[Slot, ...]:
    """The wiring of `config` (standard, ladder, hybrid or upper_bound), module by module."""
    ladder = config.ladder_layer_set()
    return tuple(
        Slot(i, name, deferred=i in ladder and (i, name) != (0, "attn"))
        for i in range(config.n_layers)
        for name in ("attn", "mlp")
    )


def run(config, layers, x_btd, positions_bt, inv_freq, caches=None):
    """The stream through `layers` (the model's `Layer`s) inside shard_map, wired by
    `config.residual`. With `caches` (a (k, v) per layer) the attention modules read and write
    them. Returns (x, updated caches or None)."""
    if config.residual == "parallel":
        return _parallel(config, layers, x_btd, positions_bt, inv_freq, caches)
    modules = [
        pair
        for layer in layers
        for pair in ((layer.attn_norm, layer.attn), (layer.mlp_norm, layer.mlp))
    ]
    slots = wiring(config)
    graphdefs, states = [], []
    for norm, module in modules:
        (gn, sn), (gm, sm) = nnx.split(norm), nnx.split(module)
        graphdefs.append((gn, gm))
        states.append((sn, sm))
    plan = _Plan(
        config.dtype,
        config.residual == "upper_bound",
        config.remat == "module",
        config.remat == "matmuls",
        slots,
        tuple(graphdefs),
        caches is not None and folds(layers[0]),
    )
    if caches is None and any(s.deferred for s in slots):
        return _ladder_stream(plan, states, x_btd, positions_bt, inv_freq), None
    if plan.fold:
        return _decode_stream(plan, states, x_btd, positions_bt, inv_freq, caches)
    return _stream(plan, states, x_btd, positions_bt, inv_freq, caches=caches)


def _parallel(config, layers, x_btd, positions_bt, inv_freq, caches=None):
    """parallel: h = attn_norm(x); x = x + psum(A(h) + M(h)), one all-reduce per layer (the
    MLP's norm is unused). A decoding clone's layers (`Layer.fused_in`) compute all five input
    projections as one matmul."""

    def both(attn, mlp, h_btd):  # one partial sum for the pair: one all-reduce
        return attn(h_btd, positions_bt, inv_freq) + mlp(h_btd)

    if config.remat != "none":
        both = nnx.remat(both, policy=MATMULS if config.remat == "matmuls" else None)
    new_caches = None if caches is None else []
    pending = None  # decoding folds: the layer's reduced output joins in the next prologue
    for i, layer in enumerate(layers):
        with jax.named_scope(f"layer{i}.parallel"):
            cache = None if caches is None else caches[i]
            if caches is not None and layer.fused_in is not None and folds(layer):  # kernels
                y_btc = layer.fused_in(
                    x_btd, config.dtype, norm=layer.attn_norm, joins=pending, split=False
                )
                y_btc, x_btd = y_btc if pending is not None else (y_btc, x_btd)
                a, cache = _attend_five_way(layer, y_btc, positions_bt, inv_freq, cache)
                new_caches.append(cache)
                pending = sharding.reduce_tp(a + layer.mlp.down_from(layer.fused_in, y_btc, 3))
                continue
            # tp-varying from here: the backward's input all-reduce (none at tp=1)
            h_btd = sharding.vary_tp(layer.attn_norm(x_btd).astype(config.dtype))
            if layer.fused_in is not None:  # decoding: one matmul for all five
                y_btc = layer.fused_in(h_btd, config.dtype, split=False)
                a = _attend_five_way(layer, y_btc, positions_bt, inv_freq, cache)
                m_btd = layer.mlp.down_from(layer.fused_in, y_btc, 3)
            elif caches is None:
                a, m_btd = both(layer.attn, layer.mlp, h_btd), None
            else:
                a, m_btd = layer.attn(h_btd, positions_bt, inv_freq, cache), layer.mlp(h_btd)
            if cache is not None:
                a, cache = a
                new_caches.append(cache)
            y_btd = a if m_btd is None else a + m_btd
            x_btd = x_btd + sharding.reduce_tp(y_btd)
    return (x_btd if pending is None else x_btd + pending), new_caches


def _attend_five_way(layer, y_btc, positions_bt, inv_freq, cache):
    """The attention of a parallel layer from its five-way projection's unsplit output
    (q, k, v, gate, up): on the Triton kernel (`ragged.attend_new`) the output as it lies,
    whose q/k/v columns the kernel reads in place; elsewhere split into q, k, v. Splitting
    and concatenating q/k/v back for the kernel is a copy XLA does not fuse away (a
    concatenate fusion per layer)."""
    attn = layer.attn
    if attn._writes_in_kernel(y_btc.shape[1], positions_bt, cache):
        n_heads = layer.fused_in.parts[0][0]  # this rank's query heads
        return attn.attend_rows(y_btc, 0, positions_bt, inv_freq, cache, n_heads=n_heads)
    q, k, v, _, _ = layer.fused_in.split(y_btc)
    return attn.attend_and_project(q, k, v, positions_bt, inv_freq, cache)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What `_stream` and its backward need that is not an array (hashable)."""

    dtype: str
    no_reduce: bool  # upper_bound: the stream itself becomes tp-varying
    remat: bool  # modules keep only their inputs for the backward (config.REMAT)
    matmuls: bool  # modules keep their inputs and weight matmuls' outputs (remat="matmuls")
    slots: tuple[Slot, ...]
    graphdefs: tuple  # (norm graphdef, module graphdef) per slot
    fold: bool = False  # decoding with the Triton matmul: norms and residual adds folded in


def folds(layer) -> bool:
    """Whether decoding folds the norms (and, where no all-reduce sits between, the residual
    adds) into `layer`'s matmuls: its linear layers run the Triton kernel
    (`ModelConfig.decode_matmul="pallas"` on a GPU mesh, `ladder_jax.model.matvec`)."""
    return layer.attn.o.matmul == "pallas"


def _fold_residual(plan, k: int) -> bool:
    """Whether module k's output joins the stream in its last matmul's epilogue: decoding
    folds, nothing sits between the two (tp 1: no all-reduce) and both module k and the next
    are immediate (a deferred module's stream waits for the previous output). upper_bound at
    tp > 1 joins its outputs in prologues like standard (fewer stream bytes at small shards)."""
    slots = plan.slots
    if not plan.fold or slots[k].deferred or (k + 1 < len(slots) and slots[k + 1].deferred):
        return False
    return jax.lax.axis_size(sharding.TP) == 1


# What a module keeps for its backward under `remat="matmuls"`: the outputs of matmuls without
# batch dimensions, i.e. its weight matmuls (the model's linear layers multiply (B*T, D) by
# (D, F)); attention's score and value products are batched over (B, heads) and recomputed.
MATMULS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def _functions(plan, k, positions_bt, inv_freq):
    """Module k's norm (state, x) -> h and module (state, h[, cache]) -> partial sum. The
    module's input is cast to tp-varying by the caller: in the backward that cast is the
    all-reduce of the input cotangent, which `_ladder_bwd` issues itself."""
    gn, gm = plan.graphdefs[k]

    def norm(state, x_btd):
        return nnx.merge(gn, state)(x_btd).astype(plan.dtype)

    def module(state, h_btd, cache=None):
        m = nnx.merge(gm, state)
        if plan.slots[k].name == "attn":
            return m(h_btd, positions_bt, inv_freq, cache)
        return m(h_btd)

    return norm, module


def _folded(plan, k, positions_bt, inv_freq):
    """Decoding's module k (`_Plan.fold`): (norm state, module state, x, cache, residual,
    joins) -> (its output (`residual +` it, given one), its cache or None, the stream with
    `joins` joined or None), the norm in its first matmul's kernel. x enters tp-invariant:
    the kernels type their outputs as varying like the weights."""
    gn, gm = plan.graphdefs[k]

    def module(norm_state, state, x_btd, cache, residual, joins):
        n, m = nnx.merge(gn, norm_state), nnx.merge(gm, state)
        kw = dict(norm=n, residual=residual, joins=joins)
        if plan.slots[k].name == "attn":
            out = m(x_btd, positions_bt, inv_freq, cache, **kw)
        else:
            out = m(x_btd, **kw)
        out, stream = out if joins is not None else (out, None)
        y_btd, cache = out if plan.slots[k].name == "attn" else (out, None)
        return y_btd, cache, stream

    return module


def _reduce_and_vary(plan):
    if plan.no_reduce:
        return (lambda y: y), (lambda h: h)
    return sharding.reduce_tp, sharding.vary_tp


def _stream(plan, states, x_btd, positions_bt, inv_freq, *, caches=None, vjps=None):
    """The forward of the wiring (module docstring). With `vjps` (a list) records each
    module's (norm vjp, module vjp) for the backward."""
    reduce, vary = _reduce_and_vary(plan)
    caches = None if caches is None else list(caches)
    pending = None  # the previous module's all-reduced output, not yet added to x
    for k, slot in enumerate(plan.slots):
        with jax.named_scope(f"layer{slot.layer}.{slot.name}"):  # names ops in the HLO
            if pending is not None and not slot.deferred:
                x_btd, pending = x_btd + pending, None
            norm, module = _functions(plan, k, positions_bt, inv_freq)
            norm_state, module_state = states[k]
            if caches is not None and slot.name == "attn":  # inference: nothing to remat
                y_btd, caches[slot.layer] = module(
                    module_state, vary(norm(norm_state, x_btd)), caches[slot.layer]
                )
            else:
                if plan.remat:  # keep only the stream x and the module's input h
                    norm, module = jax.checkpoint(norm), jax.checkpoint(module)
                elif plan.matmuls:  # and the module's weight matmuls' outputs
                    norm = jax.checkpoint(norm)
                    module = jax.checkpoint(module, policy=MATMULS)
                if vjps is not None and plan.remat:  # keep x alone: `_ladder_bwd` recomputes
                    y_btd = module(module_state, vary(norm(norm_state, x_btd)))
                    vjps.append(x_btd)
                elif vjps is not None:
                    h_btd, norm_vjp = jax.vjp(norm, norm_state, x_btd)
                    y_btd, module_vjp = jax.vjp(module, module_state, vary(h_btd))
                    vjps.append((norm_vjp, module_vjp))
                else:
                    y_btd = module(module_state, vary(norm(norm_state, x_btd)))
            if pending is not None:  # deferred: that all-reduce ran while `module` did
                pending, y_btd = sharding.tie(pending, y_btd)
                x_btd = x_btd + pending
            pending = reduce(y_btd)
    return x_btd + pending, caches


def _decode_stream(plan, states, x_btd, positions_bt, inv_freq, caches):
    """`_stream` of a decoding program whose matmuls fold (`_Plan.fold`): the same wiring,
    its additions moved into kernels. A module normalizes the stream in its first matmul's
    prologue, after the output still pending joins it there (`joins`: the kernel writes the
    joined stream out), so no norm or residual add runs as a kernel of its own; where nothing
    sits between a module's output and the stream (`_fold_residual`) its last matmul adds it
    in its epilogue instead. A deferred module's pending output joins in the next module's
    prologue (`late`), as `_stream` adds it after the module; the tie that keeps its
    all-reduce in flight meanwhile is the same. Where `_holds` says so, an attention module
    does not write its joined stream: the MLP after it joins the same output again, then its
    own (`linear.Joins`), and writes the stream once a layer."""
    reduce, _ = _reduce_and_vary(plan)
    caches = list(caches)
    pending = None  # the previous module's all-reduced output, not yet in x
    late = None  # a deferred module's pending output: joins in the next module's prologue
    held = ()  # outputs joined in the previous module's prologue whose stream it did not write
    for k, slot in enumerate(plan.slots):
        with jax.named_scope(f"layer{slot.layer}.{slot.name}"):
            joins = None
            if slot.deferred:
                joins, late = late, None
            else:
                if late is not None:  # a deferred module before an immediate one
                    x_btd, late = x_btd + late, None
                joins, pending = pending, None
            parts = held + (() if joins is None else (joins,))
            hold = bool(parts) and _holds(plan, k)
            held = parts if hold else ()
            residual = x_btd if not parts and _fold_residual(plan, k) else None
            joins = Joins(parts, write=not hold) if parts else None
            cache = caches[slot.layer] if slot.name == "attn" else None
            y_btd, cache, stream = _folded(plan, k, positions_bt, inv_freq)(
                *states[k], x_btd, cache, residual, joins
            )
            if cache is not None:
                caches[slot.layer] = cache
            x_btd = x_btd if stream is None else stream
            if residual is not None:  # y_btd is the stream now
                x_btd = reduce(y_btd)
                continue
            if pending is not None:  # deferred: that all-reduce ran while `module` did
                late, y_btd = sharding.tie(pending, y_btd)
            pending = reduce(y_btd)
    for rest in (*held, late, pending):
        x_btd = x_btd if rest is None else x_btd + rest
    return x_btd, caches


def _holds(plan, k: int) -> bool:
    """Whether decoding module k (an attention module that joins an output to the stream)
    leaves the joined stream unwritten: the MLP after it joins the same output in its own
    prologue before its own pending one (deferred or not, the order of the additions is
    `_stream`'s), so the stream is read twice but written once a layer."""
    slots = plan.slots
    return slots[k].name == "attn" and k + 1 < len(slots) and not _fold_residual(plan, k + 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ladder_stream(plan, states, x_btd, positions_bt, inv_freq):
    """`_stream` with the backward of the module docstring."""
    return _stream(plan, states, x_btd, positions_bt, inv_freq)[0]


def _ladder_fwd(plan, states, x_btd, positions_bt, inv_freq):
    """The forward, and what the backward needs: each module's (norm vjp, module vjp), or
    under remat only each module's input x (with the weights and positions to recompute)."""
    vjps = []
    y = _stream(plan, states, x_btd, positions_bt, inv_freq, vjps=vjps)[0]
    return y, (vjps, states if plan.remat else None, positions_bt, inv_freq)


def _ladder_bwd(plan, res, ct_x_btd):
    saved, states, positions_bt, inv_freq = res
    slots = plan.slots
    ct_states = [None] * len(slots)
    s_btd = ct_x_btd  # S: the stream's cotangent
    in_flight = None  # (k, all-reduced input cotangent of deferred module k)
    vjps = {} if plan.remat else dict(enumerate(saved))
    _, vary = _reduce_and_vary(plan)

    def recompute(k, s_btd):  # remat: module k's norm and module again, from its input x
        # Through a tie with the stream's cotangent: XLA can neither merge the recomputation
        # with the forward's (keeping the forward's activations and gathered weights alive)
        # nor run it before the backward has reached module k (holding every module's
        # recomputed activations at once).
        leaves, treedef = jax.tree.flatten((states[k], saved[k], s_btd))
        (norm_state, module_state), x_btd, _ = treedef.unflatten(sharding.tie(*leaves))
        norm, module = _functions(plan, k, positions_bt, inv_freq)
        h_btd, norm_vjp = jax.vjp(norm, norm_state, x_btd)
        _, module_vjp = jax.vjp(module, module_state, vary(h_btd))
        return norm_vjp, module_vjp

    def add_input_contribution(k, ct_h_btd, s_btd):
        ct_norm_state, ct_x_btd = vjps[k][0](ct_h_btd)
        ct_states[k] = (ct_norm_state, ct_states[k])
        return s_btd + ct_x_btd

    for k in reversed(range(len(slots))):
        slot = slots[k]
        with jax.named_scope(f"layer{slot.layer}.{slot.name}"):
            if plan.remat:
                vjps[k] = recompute(k, s_btd)
            ct_y_btd = sharding.vary_tp(s_btd.astype(plan.dtype))  # psum^T
            ct_module_state, ct_h_btd = vjps[k][1](ct_y_btd)  # module k's backward matmuls
            ct_states[k] = ct_module_state
            if in_flight is not None:  # module k+1's all-reduce ran during those matmuls
                j, ct_in_flight = in_flight
                ct_in_flight, ct_h_btd = sharding.tie(ct_in_flight, ct_h_btd)
                s_btd, in_flight = add_input_contribution(j, ct_in_flight, s_btd), None
            ct_h_btd = sharding.reduce_tp(ct_h_btd)  # module k's input-cotangent all-reduce
            if slot.deferred:
                in_flight = (k, ct_h_btd)
            else:
                s_btd = add_input_contribution(k, ct_h_btd, s_btd)
    if in_flight is not None:
        s_btd = add_input_contribution(*in_flight, s_btd)
    return ct_states, s_btd, None, None


_ladder_stream.defvjp(_ladder_fwd, _ladder_bwd)


# ---------------------------------------------------------------------------------------------
# The LM head.


@jax.custom_vjp
def lm_head(h_btd, head_dv):
    """Vocab-parallel logits (B, T, V/tp) in float32 from the tp-invariant final hidden state.
    The backward issues the all-reduce of the input cotangent, then computes the head's
    weight gradient while it is in flight."""
    return jnp.einsum(
        "BTD,DV->BTV", sharding.vary_tp(h_btd), head_dv, preferred_element_type=jnp.float32
    )


def _lm_head_fwd(h_btd, head_dv):
    return lm_head(h_btd, head_dv), (h_btd, head_dv)


def _lm_head_bwd(res, ct_btv):
    h_btd, head_dv = res
    ct_btv = ct_btv.astype(head_dv.dtype)
    ct_h_btd = sharding.reduce_tp(jnp.einsum("BTV,DV->BTD", ct_btv, head_dv))
    ct_head_dv = jnp.einsum("BTD,BTV->DV", sharding.vary_tp(h_btd), ct_btv)
    ct_h_btd, ct_head_dv = sharding.tie(ct_h_btd, ct_head_dv)
    # The data-parallel gradient sum comes after the tie: tied in, it would hold the all-reduce
    # above back until it is done too (and XLA then makes that one synchronous). A head
    # gathered over data where it is read (FSDP) is data-varying here: its gather's transpose
    # reduce-scatters the gradient instead.
    if not sharding.varies_over(head_dv, DATA):
        ct_head_dv = jax.lax.psum(ct_head_dv, DATA)
    return ct_h_btd, ct_head_dv


lm_head.defvjp(_lm_head_fwd, _lm_head_bwd)
