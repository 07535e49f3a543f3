"""Weight-only int8 quantization for decoding: half the weight bytes of bf16 per token.

    qmodel = quantize(model)                      # or ModelConfig(..., quantize="int8")
    python -m ladder_jax.decode --checkpoint runs/tiny --quantize int8

Every linear weight w (q, k, v, o, gate, up, down, an untied head) is int8 values `w` plus a
float32 `w_scale` per output channel, shaped like w with size 1 on the contracted axes, so it
is sharded like its weight. `einsum` applies the scale after the contraction (XLA:GPU then
reads 1 byte per weight); a row-parallel scale multiplies the partial sum before the psum, so
the wiring is unchanged. On CPU meshes the decoder runs a dequantized float copy. Training,
FSDP and `save_hf` refuse quantized weights; `dequantize(quantize(m))` is not `m`.
Details: docs/architecture.md#weight-only-int8.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax.config import QUANTIZE, ConfigError, check_quantize
from ladder_jax.model import sharding

# The contracted (input) axes of every linear weight, by attribute name; the others are its
# output channels, one scale each.
CONTRACTED = {"q": (0,), "k": (0,), "v": (0,), "o": (0, 1), "gate": (0,), "up": (0,),
              "down": (0,), "head": (0,)}
SCALE = "_scale"  # the scale of weight `w` is the attribute `w_scale`
_MODULES = {"attn": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down")}


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
    return tuple(jax.lax.with_sharding_constraint(a, s)
                 for a, s in zip((values, scale), shardings))


@functools.partial(jax.jit, static_argnames=("dtype", "sharding"))
def _dequantize_placed(values, scale, *, dtype, sharding):
    w = (values.astype(jnp.float32) * scale).astype(dtype)
    return jax.lax.with_sharding_constraint(w, sharding)


def quantized_param(weight: nnx.Param, name: str, mesh) -> tuple[nnx.Param, nnx.Param]:
    """(values, scale) Params of the float Param `weight` (the linear weight `name`), placed in
    its tp layout (`weight.spec`) and the scale's (`scale_spec`)."""
    if getattr(weight, "stored", weight.spec) != weight.spec:
        raise ConfigError("quantized weights are for decoding: FSDP (mesh.fsdp, training) "
                          "keeps float weights")
    contracted = CONTRACTED[name]
    ndim = len(weight.shape)
    sspec = scale_spec(weight.spec, ndim, contracted)
    values, scale = _quantize_placed(weight[...], contracted=contracted, shardings=(
        NamedSharding(mesh, weight.spec), NamedSharding(mesh, sspec)))
    return (nnx.Param(values, spec=weight.spec, stored=weight.spec),
            nnx.Param(scale, spec=sspec, stored=sspec))


def rescale(y, spec: str, scale):
    """`y`, the result of `jnp.einsum(spec, x, values)`, times the weight's scale (None: a
    float weight, `y` unchanged). The scale's output axes must end `y`, in the weight's order
    (true of every einsum of the model)."""
    if scale is None:
        return y
    ins, out = spec.replace(" ", "").split("->")
    w_letters = ins.split(",")[1]
    kept = "".join(c for c in w_letters if c in out)
    assert out.endswith(kept), f"{spec}: the weight's output axes must end the result"
    s = scale.reshape([n for n, c in zip(scale.shape, w_letters) if c in out])
    return (y.astype(jnp.float32) * s).astype(y.dtype)


def einsum(spec: str, x, weight, scale, dtype, pick=None, *, flat: bool = False):
    """Inside shard_map: `jnp.einsum(spec, x, w)` for the linear weight `weight` (an nnx Param,
    float or int8 values) read in `dtype` (`sharding.read_weight`), times `scale` (its scale
    Param, or None for a float weight) after the contraction. `pick(array)` selects from the
    weight and its scale alike (a rank's kv head). `flat`: the same product as one 2-D matmul
    (`flat_einsum`), the form XLA:CPU runs fastest."""
    w = sharding.read_weight(weight, dtype)
    s = None if scale is None else sharding.read_weight(scale, jnp.float32)
    if pick is not None:
        w = pick(w)
        s = None if s is None else pick(s)
    return rescale(flat_einsum(spec, x, w) if flat else jnp.einsum(spec, x, w), spec, s)


def flat_einsum(spec: str, x, w):
    """`jnp.einsum(spec, x, w)` for a linear layer's spec (x's trailing axes contracted with
    w's leading ones, the result x's other axes then w's: "BTD,DNH->BTNH", "BTNH,NHD->BTD")
    as one (rows, in) x (in, out) matmul between reshapes. On XLA:CPU this form's backward
    differs where it counts: the weight gradient of a 3-D einsum is compiled as a product of
    two transposed operands (one copied transposed first), slower than the (in, rows) x
    (rows, out) product of the 2-D form."""
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    n = sum(1 for c in xs if c in ws)  # contracted axes
    if not (xs[len(xs) - n:] == ws[:n] and out == xs[:len(xs) - n] + ws[n:]):
        raise ValueError(f"flat_einsum: {spec!r} is not a linear layer's contraction")
    rows, cols = x.shape[:x.ndim - n], w.shape[n:]
    k = math.prod(x.shape[x.ndim - n:])
    y = x.reshape(-1, k) @ w.reshape(k, -1)
    return y.reshape(*rows, *cols)


def _linear_modules(model):
    """(module, weight names) of every quantizable linear weight of a Transformer."""
    out = [(getattr(layer, m), names) for layer in model.layers for m, names in _MODULES.items()]
    if model.head is not None:
        out.append((model, ("head",)))
    return out


def quantize(model, mode: str = "int8"):
    """A copy of the float Transformer `model` with its linear weights quantized (`mode`:
    int8), on the same mesh; the other weights are shared, not copied."""
    check_quantize(mode)
    if mode is None:
        raise ConfigError("quantize(model, mode=None): give a mode, " + ", ".join(QUANTIZE))
    if model.config.quantize is not None:
        raise ConfigError(f"the model is quantized already ({model.config.quantize}): "
                          f"quantize its float model")
    clone = nnx.merge(*nnx.split(model))
    for module, names in _linear_modules(clone):
        for name in names:
            values, scale = quantized_param(getattr(module, name), name, clone.mesh)
            setattr(module, name, values)
            setattr(module, name + SCALE, nnx.data(scale))  # was None: a static attribute
    clone.config = dataclasses.replace(model.config, quantize=mode)
    return clone


def dequantize(model):
    """A float copy of the quantized Transformer `model`: every weight values * scale in the
    config's `param_dtype`, in its sharding (what CPU decoding runs, see the module doc)."""
    if model.config.quantize is None:
        return model
    clone = nnx.merge(*nnx.split(model))
    dtype = jnp.dtype(model.config.param_dtype)
    for module, names in _linear_modules(clone):
        for name in names:
            values, scale = getattr(module, name), getattr(module, name + SCALE)
            w = _dequantize_placed(values[...], scale[...], dtype=dtype,
                                   sharding=NamedSharding(clone.mesh, values.spec))
            setattr(module, name, nnx.Param(w, spec=values.spec, stored=values.spec))
            setattr(module, name + SCALE, nnx.static(None))
    clone.config = dataclasses.replace(model.config, quantize=None)
    return clone


def refuse(config, what: str) -> None:
    """For the paths that need float weights (training, Hugging Face export): one line saying
    the model is quantized and what to do."""
    if config.quantize is not None:
        raise ConfigError(f"{what} needs float weights, but this model is quantized "
                          f"({config.quantize}, for decoding only): use its float source")
