"""Weight-only int8 quantization for decoding: int8 weights with a float32 scale per output
channel, which `Linear` applies after the contraction. Details and limits: docs/architecture.md
and docs/inference.md, 'Weight-only int8'.

    qmodel = quantize(model)                      # or ModelConfig(..., quantize="int8")"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax.config import QUANTIZE, ConfigError, check_quantize
from ladder_jax.model.linear import Linear

SCALE = "scale"  # the `Linear` attribute (and state path entry) of an int8 weight's scale


def scale_spec(spec: P, ndim: int, contracted) -> P:
    """The partition spec of a scale: its weight's, the contracted (size-1) axes unsplit."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return P(*[None if i in contracted else e for i, e in enumerate(entries)])


def quantize_array(w: jax.Array, contracted) -> tuple[jax.Array, jax.Array]:
    """(int8 values, float32 scale) of `w`, symmetric per output channel (module doc). An
    all-zero channel gets scale 1 (its values are 0)."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=tuple(contracted), keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return values, scale


@functools.partial(jax.jit, static_argnames=("contracted", "shardings"))
def _quantize_placed(w, *, contracted, shardings):
    values, scale = quantize_array(w, contracted)
    return tuple(jax.lax.with_sharding_constraint(a, s) for a, s in zip((values, scale), shardings))


@functools.partial(jax.jit, static_argnames=("dtype", "sharding"))
def _dequantize_placed(values, scale, *, dtype, sharding):
    w = (values.astype(jnp.float32) * scale).astype(dtype)
    return jax.lax.with_sharding_constraint(w, sharding)


def quantize_linear(linear: Linear, mesh) -> None:
    """Quantizes the float `linear` in place: int8 values placed in its tp layout and its
    scale (`scale_spec`)."""
    weight = linear.weight
    if getattr(weight, "stored", weight.spec) != weight.spec:
        raise ConfigError(
            "quantized weights are for decoding: FSDP (mesh.fsdp, training) keeps float weights"
        )
    contracted = linear.contracted
    sspec = scale_spec(weight.spec, len(weight.shape), contracted)
    values, scale = _quantize_placed(
        weight[...],
        contracted=contracted,
        shardings=(NamedSharding(mesh, weight.spec), NamedSharding(mesh, sspec)),
    )
    linear.weight = nnx.Param(values, spec=weight.spec, stored=weight.spec)
    linear.scale = nnx.data(nnx.Param(scale, spec=sspec, stored=sspec))  # was None: static


def dequantize_linear(linear: Linear, mesh, dtype) -> None:
    """The int8 `linear` made float in place: values * scale in `dtype`, in its sharding."""
    values = linear.weight
    w = _dequantize_placed(
        values[...], linear.scale[...], dtype=dtype, sharding=NamedSharding(mesh, values.spec)
    )
    linear.weight = nnx.Param(w, spec=values.spec, stored=values.spec)
    linear.scale = nnx.static(None)


def linears(model) -> list[Linear]:
    """Every `Linear` of a Transformer: its quantizable weights."""
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Linear)]


def quantize(model, mode: str = "int8"):
    """A copy of the float Transformer `model` with its linear weights quantized (`mode`:
    int8), on the same mesh; the other weights are shared, not copied."""
    check_quantize(mode)
    if mode is None:
        raise ConfigError("quantize(model, mode=None): give a mode, " + ", ".join(QUANTIZE))
    if model.config.quantize is not None:
        raise ConfigError(
            f"the model is quantized already ({model.config.quantize}): quantize its float model"
        )
    clone = nnx.merge(*nnx.split(model))
    for linear in linears(clone):
        quantize_linear(linear, clone.mesh)
    clone.config = dataclasses.replace(model.config, quantize=mode)
    return clone


def dequantize(model):
    """A float copy of the quantized Transformer `model`: every weight values * scale in the
    config's `param_dtype`, in its sharding (what CPU decoding runs, see the module doc)."""
    if model.config.quantize is None:
        return model
    clone = nnx.merge(*nnx.split(model))
    dtype = jnp.dtype(model.config.param_dtype)
    for linear in linears(clone):
        dequantize_linear(linear, clone.mesh, dtype)
    clone.config = dataclasses.replace(model.config, quantize=None)
    return clone


def refuse(config, what: str) -> None:
    """For the paths that need float weights (training, Hugging Face export): one line saying
    the model is quantized and what to do."""
    if config.quantize is not None:
        raise ConfigError(
            f"{what} needs float weights, but this model is quantized "
            f"({config.quantize}, for decoding only): use its float source"
        )
