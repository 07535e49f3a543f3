"""The training step as pure functions: loss, optimizer, one update. Used by the overlap tool
(phase `train`) and by training.

    params, opt_state, metrics = train_step(graphdef, params, opt_state, tokens, targets,
                                            optimizer=optimizer)

`params` is the model's `nnx.State` of weights; the step runs the model's shard_map forward,
the backward through it, global-norm clipping and AdamW (the paper's defaults).

Gradient accumulation: tokens/targets of shape (A, B, T) are A micro-batches, scanned; the
update uses the mean of their gradients (the same as one (A*B, T) batch, up to rounding).

Non-finite guard: when the loss or the gradient norm is not finite, the update is not applied:
params and optimizer state come back unchanged (the schedule does not advance either) and
`metrics["skipped"]` is 1. The caller counts and stops after too many in a row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ladder_jax import sharding
from ladder_jax.config import OptimizerConfig
from ladder_jax.model import param_specs


def make_schedule(cfg: OptimizerConfig | None = None, total_steps: int = 10_000) -> optax.Schedule:
    """Linear warmup from 0 to `peak_lr`, then cosine decay over the rest of `total_steps` to
    `peak_lr * end_lr_fraction`."""
    cfg = cfg or OptimizerConfig()
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.peak_lr, max(cfg.warmup_steps, 1), max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.peak_lr * cfg.end_lr_fraction)


def make_optimizer(cfg: OptimizerConfig | None = None,
                   total_steps: int = 10_000) -> optax.GradientTransformation:
    """AdamW on `make_schedule`. Gradient clipping is done by `train_step` (it needs the
    global norm anyway, and computing it once saves one reduction per weight)."""
    cfg = cfg or OptimizerConfig()
    return optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay)


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


def loss_fn(graphdef, params, tokens_bt, targets_bt, mask_bt=None):
    model = nnx.merge(graphdef, params)
    return cross_entropy(model(tokens_bt), targets_bt, mask_bt)


def loss_and_grads(graphdef, params, tokens, targets, mask=None):
    """Loss and gradients of one (B, T) batch, or the means over (A, B, T) micro-batches."""
    grad_fn = jax.value_and_grad(loss_fn, argnums=1)
    if tokens.ndim == 2:
        return grad_fn(graphdef, params, tokens, targets, mask)
    n = tokens.shape[0]

    def micro(carry, batch):
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(graphdef, params, *batch)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss_sum, grad_sum), _ = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros),
                                           (tokens, targets, mask))
    return loss_sum / n, jax.tree.map(lambda g: g / n, grad_sum)


def train_step(graphdef, params, opt_state, tokens_bt, targets_bt, *, optimizer, grad_clip=1.0,
               mask_bt=None):
    """One update. tokens/targets (B, T), or (A, B, T) for A accumulated micro-batches."""
    loss, grads = loss_and_grads(graphdef, params, tokens_bt, targets_bt, mask_bt)
    mesh = nnx.merge(graphdef, params).mesh
    grad_norm = sharding.global_norm(grads, param_specs(params), mesh)  # one all-reduce
    scale = jnp.minimum(1.0, grad_clip / jnp.maximum(grad_norm, 1e-12))
    grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm,
                               "skipped": (~finite).astype(jnp.int32)}
