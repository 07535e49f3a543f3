"""The training step as pure functions: loss, optimizer, one update (`make_train_step`), which
the trainer and the deviceless report (`overlap --config`) build alike. Tokens (A, B, T) are A
accumulated micro-batches; a non-finite step leaves the state unchanged (`metrics["skipped"]`).

    params, opt_state, metrics = train_step(graphdef, params, opt_state, tokens, targets,
                                            optimizer=optimizer, shardings=shardings)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax.config import ConfigError
from ladder_jax.model import collectives
from ladder_jax.train_config import OptimizerConfig


@struct.dataclass
class TrainState:
    """A run's state between steps: `params` (the model's `nnx.State` of weights), `opt_state`
    (the optimizer's, stored like the weights: `opt_state_shardings`) and `step` (steps taken, a
    Python int: not traced). A pytree of the arrays; `step` is static metadata."""

    params: nnx.State
    opt_state: optax.OptState
    step: int = struct.field(pytree_node=False, default=0)


def lr_schedule(cfg: OptimizerConfig | None = None, total_steps: int = 10_000) -> optax.Schedule:
    """Linear warmup from 0 to `peak_lr`, then cosine decay over the rest of `total_steps` to
    `peak_lr * end_lr_fraction`."""
    cfg = cfg or OptimizerConfig()
    return optax.warmup_cosine_decay_schedule(
        0.0,
        cfg.peak_lr,
        max(cfg.warmup_steps, 1),
        max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.peak_lr * cfg.end_lr_fraction,
    )


def make_optimizer(
    cfg: OptimizerConfig | None = None, total_steps: int = 10_000
) -> optax.GradientTransformation:
    """AdamW on `lr_schedule`. Gradient clipping is done by `train_step` (it needs the
    global norm anyway, and computing it once saves one reduction per weight)."""
    cfg = cfg or OptimizerConfig()
    return optax.adamw(
        lr_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


def cross_entropy(logits_btv, targets_bt, mask_bt=None):
    """Mean next-token cross-entropy in float32 (log-sum-exp over V, sharded or not)."""
    logits = logits_btv.astype(jnp.float32)
    lse_bt = jax.nn.logsumexp(logits, axis=-1)
    target_logit_bt = jnp.take_along_axis(logits, targets_bt[..., None], axis=-1)[..., 0]
    nll_bt = lse_bt - target_logit_bt
    if mask_bt is None:
        return nll_bt.mean()
    mask_bt = mask_bt.astype(jnp.float32)
    return (nll_bt * mask_bt).sum() / jnp.maximum(mask_bt.sum(), 1.0)


def chunked_cross_entropy(
    h_btd, head, targets_bt, mask_bt=None, *, chunk: int, head_layout: str = "dv"
):
    """`cross_entropy(h_btd @ head_dv, targets_bt, mask_bt)` computed `chunk` positions of the
    sequence at a time: at most (B, chunk, V) float32 logits (and their gradient) are live,
    never (B, T, V). Differentiated, each chunk's gradients (of `h_btd` and the head) are
    computed in the forward while its logits are live (`_nll_sum`), so no logits are
    recomputed. Equal to the plain loss and its gradients up to float rounding (the sums run in
    another order). `head`: (D, V) for `head_layout="dv"`, (V, D) for "vd" (a tied head as
    the embedding stores it: no transposed copy of it, and the products over V that the
    gradients need run on XLA:CPU ~1.2x faster in that form: `_HEAD_EQUATIONS`).

        h = model.hidden(t)
        loss = chunked_cross_entropy(h, model.head_weight(model.head_layout()), targets,
                                     chunk=64, head_layout=model.head_layout())
    """
    if head_layout not in _HEAD_EQUATIONS:
        raise ValueError(f"head_layout={head_layout!r}: choose one of {', '.join(_HEAD_EQUATIONS)}")
    B, T, D = h_btd.shape
    chunk = max(1, min(int(chunk), T))
    n = -(-T // chunk)
    weight_bt = jnp.ones((B, T), jnp.float32) if mask_bt is None else mask_bt.astype(jnp.float32)
    pad = n * chunk - T  # a short last chunk: padded, its padding weighted 0
    if pad:
        h_btd = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0)))
        targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
        weight_bt = jnp.pad(weight_bt, ((0, 0), (0, pad)))
    split = lambda x: jnp.moveaxis(x.reshape(B, n, chunk, *x.shape[2:]), 1, 0)  # noqa: E731
    total = _nll_sum(head_layout, split(h_btd), head, split(targets_bt), split(weight_bt))
    if mask_bt is None:
        return total / (B * T)
    return total / jnp.maximum(weight_bt.sum(), 1.0)


# The head's three products per chunk, per layout: logits, the gradient of h, the gradient of
# the head. With the head as (V, D) (a tied embedding) the two gradients are a plain product
# and one over the chunk's rows; as (D, V) the head's gradient comes out transposed against
# how XLA:CPU's GEMMs write best. The loss and gradients of SmolLM2-135M's head (batch 8 x 256,
# vocabulary 49152, chunk 64) took 1.94 s as (D, V) and 1.65 s as (V, D) on a 2-core Xeon
# (transformers' whole-logits loss: 1.39 s).
_HEAD_EQUATIONS = {
    "dv": ("BCD,DV->BCV", "BCV,DV->BCD", "BCD,BCV->DV"),
    "vd": ("BCD,VD->BCV", "BCV,VD->BCD", "BCV,BCD->VD"),
}


def _chunk_nll(layout, h_bcd, head, targets_bc):
    """Logits (float32), their log-sum-exp and each position's NLL, for one chunk."""
    eq = _HEAD_EQUATIONS[layout][0]
    logits_bcv = jnp.einsum(eq, h_bcd, head, preferred_element_type=jnp.float32)
    lse_bc = jax.nn.logsumexp(logits_bcv, axis=-1)
    target_bc = jnp.take_along_axis(logits_bcv, targets_bc[..., None], axis=-1)[..., 0]
    return logits_bcv, lse_bc, lse_bc - target_bc


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nll_sum(layout, h_nbcd, head, targets_nbc, weight_nbc):
    """The weighted NLL summed over n chunks of (B, C) positions, one chunk at a time."""

    def body(total, xs):
        h_bcd, targets_bc, weight_bc = xs
        return total + (_chunk_nll(layout, h_bcd, head, targets_bc)[2] * weight_bc).sum(), None

    zero = jnp.zeros((), jnp.float32)
    return jax.lax.scan(body, zero, (h_nbcd, targets_nbc, weight_nbc))[0]


def _nll_sum_fwd(layout, h_nbcd, head, targets_nbc, weight_nbc):
    """The sum and, from each chunk's live logits, its gradients: d/dlogits = weight x
    (softmax - one-hot target), carried back to h (per chunk) and to the head (summed)."""
    _, eq_h, eq_head = _HEAD_EQUATIONS[layout]

    def body(carry, xs):
        total, g_head = carry
        h_bcd, targets_bc, weight_bc = xs
        logits_bcv, lse_bc, nll_bc = _chunk_nll(layout, h_bcd, head, targets_bc)
        hot_bcv = jax.nn.one_hot(targets_bc, logits_bcv.shape[-1], dtype=jnp.float32)
        g_bcv = (jnp.exp(logits_bcv - lse_bc[..., None]) - hot_bcv) * weight_bc[..., None]
        g_h_bcd = jnp.einsum(eq_h, g_bcv.astype(head.dtype), head)
        g_in = g_bcv.astype(h_bcd.dtype)  # the matmuls' operands in the compute dtype
        pair = (h_bcd, g_in) if layout == "dv" else (g_in, h_bcd)
        g_head = g_head + jnp.einsum(eq_head, *pair, preferred_element_type=jnp.float32)
        total = total + (nll_bc * weight_bc).sum()
        return (total, g_head), (g_h_bcd.astype(h_bcd.dtype), nll_bc)

    init = (jnp.zeros((), jnp.float32), jnp.zeros(head.shape, jnp.float32))
    (total, g_head), (g_h_nbcd, nll_nbc) = jax.lax.scan(
        body, init, (h_nbcd, targets_nbc, weight_nbc)
    )
    return total, (g_h_nbcd, g_head.astype(head.dtype), nll_nbc)


def _nll_sum_bwd(layout, res, ct):
    g_h_nbcd, g_head, nll_nbc = res
    ct_targets = np.zeros(nll_nbc.shape, jax.dtypes.float0)  # integers: no cotangent
    return (
        (ct * g_h_nbcd).astype(g_h_nbcd.dtype),
        (ct * g_head).astype(g_head.dtype),
        ct_targets,
        ct * nll_nbc,
    )


_nll_sum.defvjp(_nll_sum_fwd, _nll_sum_bwd)


def loss_fn(graphdef, params, tokens_bt, targets_bt, mask_bt=None, loss_chunk: int = 0):
    """Mean next-token cross-entropy of the model (`graphdef`, `params`) on a batch.
    `loss_chunk` > 0: `chunked_cross_entropy` over that many positions at a time (the same
    loss up to rounding, in less memory); 0: the plain one, over the whole logits."""
    model = nnx.merge(graphdef, params)
    if loss_chunk and model.config.residual != "upper_bound":
        layout = model.head_layout()
        return chunked_cross_entropy(
            model.hidden(tokens_bt),
            model.head_weight(layout),
            targets_bt,
            mask_bt,
            chunk=loss_chunk,
            head_layout=layout,
        )
    return cross_entropy(model(tokens_bt), targets_bt, mask_bt)


def loss_and_grads(graphdef, params, tokens, targets, mask=None, loss_chunk: int = 0, loss=None):
    """Loss and gradients of one (B, T) batch, or the means over (A, B, T) micro-batches.
    `loss`: a function like `loss_fn` (default, with `loss_chunk`), e.g.
    `ladder_jax.train.distill.make_loss`."""
    grad_fn = jax.value_and_grad(
        loss or functools.partial(loss_fn, loss_chunk=loss_chunk), argnums=1
    )
    if tokens.ndim == 2:
        return grad_fn(graphdef, params, tokens, targets, mask)
    n = tokens.shape[0]

    def micro(carry, batch):
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(graphdef, params, *batch)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss_sum, grad_sum), _ = jax.lax.scan(
        micro, (jnp.zeros((), jnp.float32), zeros), (tokens, targets, mask)
    )
    return loss_sum / n, jax.tree.map(lambda g: g / n, grad_sum)


def shardings_of(tree):
    """The `NamedSharding` of every array in `tree` (a tree of the same structure): where a
    run's state is stored, the one form of layout `train_step` and `make_train_step` take."""
    return jax.tree.map(lambda x: x.sharding, tree)


def train_step(
    graphdef,
    params,
    opt_state,
    tokens_bt,
    targets_bt,
    *,
    optimizer,
    shardings,
    grad_clip=1.0,
    mask_bt=None,
    loss_chunk: int = 0,
    loss=None,
):
    """One update. tokens/targets (B, T), or (A, B, T) for A accumulated micro-batches.
    `shardings`: where the weights are stored (`shardings_of(params)`, e.g. the FSDP layout):
    the gradients are kept in that layout, so clipping and AdamW run on each device's own
    blocks, with no gathering. A non-finite loss or gradient norm returns `params` and
    `opt_state` as they came in (`metrics["skipped"]` = 1; on CPU the update is a `lax.cond`
    branch, so a donated state is updated in place). `loss_chunk`, `loss`: see
    `loss_fn`, `loss_and_grads`."""
    loss, grads = loss_and_grads(graphdef, params, tokens_bt, targets_bt, mask_bt, loss_chunk, loss)
    grads = jax.tree.map(jax.lax.with_sharding_constraint, grads, shardings)
    grad_norm = collectives.global_norm(grads, shardings)  # one all-reduce
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(params, opt_state, grads):
        scale = jnp.minimum(1.0, grad_clip / jnp.maximum(grad_norm, 1e-12))
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def keep(params, opt_state, grads):
        return params, opt_state

    if _on_cpu(shardings):
        # a branch, not a select of new against old: XLA:CPU then writes each moment and
        # weight once, in place, with no copy of the old state kept for the select to read
        # (XLA:GPU gives a branch's outputs buffers of their own: a state-sized temporary)
        params, opt_state = jax.lax.cond(finite, update, keep, params, opt_state, grads)
    else:
        new_params, new_opt_state = update(params, opt_state, grads)
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (new_params, new_opt_state),
            (params, opt_state),
        )
    return (
        params,
        opt_state,
        {"loss": loss, "grad_norm": grad_norm, "skipped": (~finite).astype(jnp.int32)},
    )


def _on_cpu(shardings) -> bool:
    """Whether the state stored in `shardings` (NamedShardings) lives on CPU devices."""
    leaf = jax.tree.leaves(shardings)[0]
    mesh = getattr(leaf, "mesh", None)
    device = mesh.devices.flat[0] if mesh is not None else next(iter(leaf.device_set))
    return device.platform == "cpu"


# ---------------------------------------------------------------------------------------------
# The step a training run compiles (shared by the trainer and `ladder_jax.overlap --config`).


def opt_state_shardings(optimizer, opt_state, params, mesh):
    """The optimizer state's shardings: every copy of the parameter tree in it (Adam's moments)
    is stored like `params` (arrays or shape structs that carry shardings), everything else
    (step counters) is replicated on the mesh."""
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        optimizer,
        lambda _, p: p.sharding,
        opt_state,
        params,
        transform_non_params=lambda x: jax.tree.map(lambda _: replicated, x),
    )


def make_train_step(
    graphdef,
    *,
    optimizer,
    grad_clip,
    param_shardings,
    opt_shardings,
    loss_chunk: int = 0,
    loss=None,
):
    """The function a training run jits: (params, opt_state, batch) -> (params, opt_state,
    metrics). `batch` is (A, B, T + 1) int tokens, A accumulated micro-batches (A = 1: no
    accumulation loop); `loss_chunk` as in `loss_fn`. `param_shardings`, `opt_shardings`:
    the NamedShardings of the state's leaves (`shardings_of`, or its leaves in a list); the
    new state is constrained to them, so that it comes back stored as it went in (donated in
    place)."""

    def like(tree, shardings):
        return jax.tree.structure(tree).unflatten(jax.tree.leaves(shardings))

    def step(params, opt_state, batch_abt):
        tokens, targets = batch_abt[..., :-1], batch_abt[..., 1:]
        if tokens.shape[0] == 1:
            tokens, targets = tokens[0], targets[0]
        p_shardings, o_shardings = like(params, param_shardings), like(opt_state, opt_shardings)
        params, opt_state, metrics = train_step(
            graphdef,
            params,
            opt_state,
            tokens,
            targets,
            optimizer=optimizer,
            shardings=p_shardings,
            grad_clip=grad_clip,
            loss_chunk=loss_chunk,
            loss=loss,
        )
        constrain = functools.partial(jax.tree.map, jax.lax.with_sharding_constraint)
        return constrain(params, p_shardings), constrain(opt_state, o_shardings), metrics

    return step


def memory_use(compiled) -> dict:
    """Per-device bytes of a compiled program (XLA's memory analysis): `arguments` (weights,
    optimizer state, batch), `outputs`, `aliased` (outputs written in place of donated
    arguments), `temporaries` (activations, gradients, gathered weights, workspace) and `peak`
    = arguments + temporaries + outputs not aliased: everything the program can hold at once,
    an upper bound that ignores the runtime's own buffers (communication, kernel workspace)."""
    m = compiled.memory_analysis()
    args, outs = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temps = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    code = int(getattr(m, "generated_code_size_in_bytes", 0) or 0)
    return {
        "arguments": args,
        "outputs": outs,
        "aliased": alias,
        "temporaries": temps,
        "peak": args + temps + max(outs - alias, 0) + code,
    }


def check_memory(use: dict, capacity: int, cfg, *, where: str = "per device") -> None:
    """Raises a one-line ConfigError when the compiled step (`memory_use`) will not fit in
    `capacity` bytes, naming the fixes that apply to `cfg` (a TrainConfig), largest saving
    first: FSDP / more data-parallel devices when weights and optimizer state dominate,
    `model.remat=module` and a smaller micro-batch with more accumulation when temporaries do."""
    if use["peak"] <= capacity:
        return
    gb = lambda b: f"{b / 1e9:.1f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"  # noqa: E731
    state_first = use["arguments"] >= use["temporaries"]
    fixes_state, fixes_act = [], []
    if not cfg.mesh.fsdp:
        fixes_state.append("mesh.fsdp=true (weights and optimizer state split over data)")
    else:
        fixes_state.append(
            "more data-parallel devices (mesh.data, more hosts: FSDP splits the state further)"
        )
    if cfg.model.param_dtype == "float32" and not cfg.mesh.fsdp:
        fixes_state.append("or model.param_dtype=bfloat16")
    if (cfg.model.remat or "none") == "none":
        fixes_act.append("model.remat=module")
    b, a = cfg.data.batch_size, cfg.data.grad_accum
    n_data = cfg.mesh.data or 1
    if b // 2 >= n_data and b % 2 == 0:
        fixes_act.append(f"data.batch_size={b // 2} data.grad_accum={2 * a} (same tokens per step)")
    fixes = fixes_state + fixes_act if state_first else fixes_act + fixes_state
    raise ConfigError(
        f"the training step needs {gb(use['peak'])} {where} but the device has "
        f"{gb(capacity)} (weights + optimizer state + batch {gb(use['arguments'])}, "
        f"temporaries {gb(use['temporaries'])}): try {'; '.join(fixes)}"
    )
