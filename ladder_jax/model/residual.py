"""The residual stream of every scheme in its training form: `run` wires the layers; standard,
ladder, hybrid and upper_bound follow one wiring (with a hand-written backward that overlaps
its all-reduces too), parallel runs beside them. docs/architecture.md, 'The residual wiring'.

    slots = wiring(config)        # one Slot per module: immediate or deferred"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ladder_jax.model import collectives
from ladder_jax.model.layout import DATA


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


def run(config, layers, x_btd, positions_bt, inv_freq):
    """The stream through `layers` (the model's `Layer`s) inside shard_map, wired by
    `config.residual`: the training form (a KV cache's forward is `ladder_jax.model.decode`).
    Returns x."""
    if config.residual == "parallel":
        return _parallel(config, layers, x_btd, positions_bt, inv_freq)
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
    )
    if any(s.deferred for s in slots):
        return _ladder_stream(plan, states, x_btd, positions_bt, inv_freq)
    return _stream(plan, states, x_btd, positions_bt, inv_freq)


def _parallel(config, layers, x_btd, positions_bt, inv_freq):
    """parallel: h = attn_norm(x); x = x + psum(A(h) + M(h)), one all-reduce per layer (the
    MLP's norm is unused)."""

    def both(attn, mlp, h_btd):  # one partial sum for the pair: one all-reduce
        return attn(h_btd, positions_bt, inv_freq) + mlp(h_btd)

    if config.remat != "none":
        both = nnx.remat(both, policy=MATMULS if config.remat == "matmuls" else None)
    for i, layer in enumerate(layers):
        with jax.named_scope(f"layer{i}.parallel"):
            # tp-varying from here: the backward's input all-reduce (none at tp=1)
            h_btd = collectives.vary_tp(layer.attn_norm(x_btd).astype(config.dtype))
            x_btd = x_btd + collectives.reduce_tp(both(layer.attn, layer.mlp, h_btd))
    return x_btd


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What `_stream` and its backward need that is not an array (hashable)."""

    dtype: str
    no_reduce: bool  # upper_bound: the stream itself becomes tp-varying
    remat: bool  # modules keep only their inputs for the backward (config.REMAT)
    matmuls: bool  # modules keep their inputs and weight matmuls' outputs (remat="matmuls")
    slots: tuple[Slot, ...]
    graphdefs: tuple  # (norm graphdef, module graphdef) per slot


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

    def module(state, h_btd):
        m = nnx.merge(gm, state)
        if plan.slots[k].name == "attn":
            return m(h_btd, positions_bt, inv_freq)
        return m(h_btd)

    return norm, module


def reduce_and_vary(no_reduce: bool):
    """(reduce, vary): a module output's all-reduce and its input's cast to tp-varying; both
    the identity for upper_bound (`no_reduce`), whose stream is tp-varying itself."""
    if no_reduce:
        return (lambda y: y), (lambda h: h)
    return collectives.reduce_tp, collectives.vary_tp


def _stream(plan, states, x_btd, positions_bt, inv_freq, *, vjps=None):
    """The forward of the wiring (docs/architecture.md, 'The residual wiring'). With `vjps` (a
    list) records each module's (norm vjp, module vjp) for the backward."""
    reduce, vary = reduce_and_vary(plan.no_reduce)
    pending = None  # the previous module's all-reduced output, not yet added to x
    for k, slot in enumerate(plan.slots):
        with jax.named_scope(f"layer{slot.layer}.{slot.name}"):  # names ops in the HLO
            if pending is not None and not slot.deferred:
                x_btd, pending = x_btd + pending, None
            norm, module = _functions(plan, k, positions_bt, inv_freq)
            norm_state, module_state = states[k]
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
                pending, y_btd = collectives.tie(pending, y_btd)
                x_btd = x_btd + pending
            pending = reduce(y_btd)
    return x_btd + pending


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ladder_stream(plan, states, x_btd, positions_bt, inv_freq):
    """`_stream` with the backward of docs/architecture.md, 'The residual wiring'."""
    return _stream(plan, states, x_btd, positions_bt, inv_freq)


def _ladder_fwd(plan, states, x_btd, positions_bt, inv_freq):
    """The forward, and what the backward needs: each module's (norm vjp, module vjp), or
    under remat only each module's input x (with the weights and positions to recompute)."""
    vjps = []
    y = _stream(plan, states, x_btd, positions_bt, inv_freq, vjps=vjps)
    return y, (vjps, states if plan.remat else None, positions_bt, inv_freq)


def _ladder_bwd(plan, res, ct_x_btd):
    saved, states, positions_bt, inv_freq = res
    slots = plan.slots
    ct_states = [None] * len(slots)
    s_btd = ct_x_btd  # S: the stream's cotangent
    in_flight = None  # (k, all-reduced input cotangent of deferred module k)
    vjps = {} if plan.remat else dict(enumerate(saved))
    _, vary = reduce_and_vary(plan.no_reduce)

    def recompute(k, s_btd):  # remat: module k's norm and module again, from its input x
        # Through a tie with the stream's cotangent: XLA can neither merge the recomputation
        # with the forward's (keeping the forward's activations and gathered weights alive)
        # nor run it before the backward has reached module k (holding every module's
        # recomputed activations at once).
        leaves, treedef = jax.tree.flatten((states[k], saved[k], s_btd))
        (norm_state, module_state), x_btd, _ = treedef.unflatten(collectives.tie(*leaves))
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
            ct_y_btd = collectives.vary_tp(s_btd.astype(plan.dtype))  # psum^T
            ct_module_state, ct_h_btd = vjps[k][1](ct_y_btd)  # module k's backward matmuls
            ct_states[k] = ct_module_state
            if in_flight is not None:  # module k+1's all-reduce ran during those matmuls
                j, ct_in_flight = in_flight
                ct_in_flight, ct_h_btd = collectives.tie(ct_in_flight, ct_h_btd)
                s_btd, in_flight = add_input_contribution(j, ct_in_flight, s_btd), None
            ct_h_btd = collectives.reduce_tp(ct_h_btd)  # module k's input-cotangent all-reduce
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
        "BTD,DV->BTV", collectives.vary_tp(h_btd), head_dv, preferred_element_type=jnp.float32
    )


def _lm_head_fwd(h_btd, head_dv):
    return lm_head(h_btd, head_dv), (h_btd, head_dv)


def _lm_head_bwd(res, ct_btv):
    h_btd, head_dv = res
    ct_btv = ct_btv.astype(head_dv.dtype)
    ct_h_btd = collectives.reduce_tp(jnp.einsum("BTV,DV->BTD", ct_btv, head_dv))
    ct_head_dv = jnp.einsum("BTD,BTV->DV", collectives.vary_tp(h_btd), ct_btv)
    ct_h_btd, ct_head_dv = collectives.tie(ct_h_btd, ct_head_dv)
    # The data-parallel gradient sum comes after the tie: tied in, it would hold the all-reduce
    # above back until it is done too (and XLA then makes that one synchronous). A head
    # gathered over data where it is read (FSDP) is data-varying here: its gather's transpose
    # reduce-scatters the gradient instead.
    if not collectives.varies_over(head_dv, DATA):
        ct_head_dv = jax.lax.psum(ct_head_dv, DATA)
    return ct_h_btd, ct_head_dv


lm_head.defvjp(_lm_head_fwd, _lm_head_bwd)
