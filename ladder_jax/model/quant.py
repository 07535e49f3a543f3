"""Weight-only int8 quantization for decoding: half the weight bytes of bf16 per token.

    qmodel = quantize(model)                      # or ModelConfig(..., quantize="int8")
    lj.load("runs/tiny", quantize="int8")         # lj.load_hf(..., quantize="int8") too
    python -m ladder_jax.decode --checkpoint runs/tiny --quantize int8
    python -m ladder_jax.convert --checkpoint runs/tiny --out runs/tiny-int8 --quantize int8

The representation (`ModelConfig.quantize="int8"`). Every linear weight -- q, k, v, o, gate,
up, down and the untied LM head, each a `Linear` -- is stored as int8 values `weight` and a
float32 `scale`, symmetric and per output channel: scale = max |w| over the weight's contracted
(input) axes / 127, values = round(w / scale) in [-127, 127]. The scale keeps the weight's
rank with size 1 on the contracted axes (q (D, N, H) -> (1, N, H); o (N, H, D) -> (1, 1, D)),
so it is sharded exactly like its weight with the contracted axes unsplit: column-parallel
scales are split over `tp` with their output axis, row-parallel scales (o, down: output D) are
replicated, and a rank picking its kv head (K < tp) picks the scale's with the same slice.
Not quantized: the embedding table (a lookup reads B rows, not the table), a *tied* LM head
(it reads that float table), the norms. Training stays float: a quantized model is for
decoding (`check` refuses `model.quantize` in a training config, and a float path that meets
a quantized checkpoint says so).

The matmul (`Linear`): y = (x @ values.astype(dtype)) * scale, the scale applied to the output
channels after the contraction (exact: it is constant along the contracted axes; in float32,
then cast to the compute dtype). Applied after, not before: XLA:GPU then fuses the int8 ->
bf16 conversion into the GEMM (a Triton GEMM fusion whose operand is the s8 parameter), so the
program reads 1 byte per weight from HBM; scaling the weight first (values * scale, then the
matmul) makes it materialize a bf16 copy of every weight per step (measured in the deviceless
H100 HLO: a `loop_multiply_fusion` of the weight's shape feeding the GEMM). Under tensor
parallelism a row-parallel module's scale multiplies its partial sum before the all-reduce
(psum(y) * s = psum(y * s)), so the ladder's wiring and overlap are unchanged.

CPU: XLA:CPU runs a matmul whose operand is converted from int8 (or bf16) as a generic loop,
not through its float32 GEMM: on this project's CPU an 8 x (4096 x 4096) matvec chain took
80 ms in float32 and 870 ms with int8 weights converted inside the jit (825 ms with the
converted weight materialized behind an optimization barrier; 1700 ms as a bf16 dot).
So on a CPU mesh the `Decoder` (`ladder_jax.inference.generation`) decodes a quantized model
through its dequantized float copy (`dequantize`: values * scale in `param_dtype`), made once
when the Decoder is built: the same numbers as the int8 program up to float rounding, at
float32 speed, with the float weights' memory. GPU meshes (and the deviceless programs of
`ladder_jax.analysis`) run the int8 program. `model(tokens)` always runs the int8 matmuls.

Footguns:
- At one token per row XLA rewrites some matvecs as a multiply fusion that writes the product
  x * w (weight-sized, bf16) and a reduce that reads it back; the bf16 program does the same
  there, and int8 then saves only the weight's read (1 of 6 bytes per element, not half).
  Deviceless H100 decode step, llama-3-8b compiled with 2 layers, kernel bytes per GPU:
  2094 MB bf16 -> 1133 MB int8 at tp=1, 394 -> 274 MB at tp=8 (where the MLP's gate / up
  products are materialized).
- `quantize` rounds every weight once; quantizing a quantized model is refused, and
  `dequantize(quantize(m))` is not `m` (the rounding stays).
- `ladder_jax.interop.hf.save_hf` writes float Llama weights only: it refuses a quantized
  model (store it with `convert --quantize int8`, or export the float model).
- FSDP (training) never holds quantized weights: `Transformer(..., fsdp=True)` refuses them.
"""

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
    return tuple(jax.lax.with_sharding_constraint(a, s)
                 for a, s in zip((values, scale), shardings))


@functools.partial(jax.jit, static_argnames=("dtype", "sharding"))
def _dequantize_placed(values, scale, *, dtype, sharding):
    w = (values.astype(jnp.float32) * scale).astype(dtype)
    return jax.lax.with_sharding_constraint(w, sharding)


def quantize_linear(linear: Linear, mesh) -> None:
    """Quantizes the float `linear` in place: int8 values placed in its tp layout and its
    scale (`scale_spec`)."""
    weight = linear.weight
    if getattr(weight, "stored", weight.spec) != weight.spec:
        raise ConfigError("quantized weights are for decoding: FSDP (mesh.fsdp, training) "
                          "keeps float weights")
    contracted = linear.contracted
    sspec = scale_spec(weight.spec, len(weight.shape), contracted)
    values, scale = _quantize_placed(weight[...], contracted=contracted, shardings=(
        NamedSharding(mesh, weight.spec), NamedSharding(mesh, sspec)))
    linear.weight = nnx.Param(values, spec=weight.spec, stored=weight.spec)
    linear.scale = nnx.data(nnx.Param(scale, spec=sspec, stored=sspec))  # was None: static


def dequantize_linear(linear: Linear, mesh, dtype) -> None:
    """The int8 `linear` made float in place: values * scale in `dtype`, in its sharding."""
    values = linear.weight
    w = _dequantize_placed(values[...], linear.scale[...], dtype=dtype,
                           sharding=NamedSharding(mesh, values.spec))
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
        raise ConfigError(f"the model is quantized already ({model.config.quantize}): "
                          f"quantize its float model")
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
        raise ConfigError(f"{what} needs float weights, but this model is quantized "
                          f"({config.quantize}, for decoding only): use its float source")
