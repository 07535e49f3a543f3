"""Distillation: a student's loss against a frozen teacher's next-token distribution,
(1 - weight) x cross-entropy + weight x T^2 x KL(teacher_T || student_T) per token
(docs/adaptation.md, 'What it does').

    python -m ladder_jax.train ... init_from=runs/smollm2 distill.teacher=runs/smollm2"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ladder_jax.config import ConfigError
from ladder_jax.loading import load_model
from ladder_jax.train import step


def kl_divergence(student_btv, teacher_btv, mask_bt=None, temperature: float = 1.0):
    """Mean over (unmasked) tokens of T^2 x KL(softmax(teacher / T) || softmax(student / T)),
    in float32; zero when the two logits agree up to a constant per token."""
    t = temperature
    log_p = jax.nn.log_softmax(teacher_btv.astype(jnp.float32) / t, axis=-1)
    log_q = jax.nn.log_softmax(student_btv.astype(jnp.float32) / t, axis=-1)
    kl_bt = (jnp.exp(log_p) * (log_p - log_q)).sum(-1) * (t * t)
    if mask_bt is None:
        return kl_bt.mean()
    mask_bt = mask_bt.astype(jnp.float32)
    return (kl_bt * mask_bt).sum() / jnp.maximum(mask_bt.sum(), 1.0)


def make_loss(teacher_graphdef, teacher_params, *, weight: float = 1.0, temperature: float = 1.0):
    """A `step.loss_fn`-like `(graphdef, params, tokens, targets, mask) -> loss` that mixes
    the data's cross-entropy and the KL to the teacher (see the module docstring)."""

    def loss(graphdef, params, tokens_bt, targets_bt, mask_bt=None):
        logits = nnx.merge(graphdef, params)(tokens_bt)
        frozen = jax.lax.stop_gradient(teacher_params)
        teacher = nnx.merge(teacher_graphdef, frozen)(tokens_bt)
        out = weight * kl_divergence(logits, teacher, mask_bt, temperature)
        if weight < 1.0:
            out = out + (1.0 - weight) * step.cross_entropy(logits, targets_bt, mask_bt)
        return out

    return loss


def make_train_step(graphdef, teacher_graphdef, *, weight: float, temperature: float, **kwargs):
    """`step.make_train_step` with the distillation loss: the function a run jits takes
    `(teacher_params, params, opt_state, batch)` (bind the teacher with functools.partial)."""

    def train_step(teacher_params, params, opt_state, batch_abt):
        loss = make_loss(teacher_graphdef, teacher_params, weight=weight, temperature=temperature)
        return step.make_train_step(graphdef, loss=loss, **kwargs)(params, opt_state, batch_abt)

    return train_step


def load_teacher(path: str, mesh, student_config):
    """(graphdef, params) of the teacher at `path` (run, `convert` output, HF directory, GGUF
    file) on `mesh`, as stored (its own residual scheme); its vocabulary must be the
    student's."""
    model, _ = load_model(path, mesh=mesh, what="distill.teacher")
    if model.config.vocab_size != student_config.vocab_size:
        raise ConfigError(
            f"distill.teacher={path!r} has vocab_size={model.config.vocab_size} "
            f"but the model has {student_config.vocab_size}: distill from a "
            f"model with the same tokenizer"
        )
    return nnx.split(model)
