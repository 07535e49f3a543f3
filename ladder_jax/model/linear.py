"""`Linear`: one linear layer's weight, its int8 scale, its layout, and the matmul that reads it.
Every matmul over a model weight goes through one; with `ModelConfig.decode_matmul="pallas"` on
GPU meshes, products of at most 16 rows run the Triton kernel of `ladder_jax.model.matvec`.

    y_btnh = attn.q(x_btd, "bfloat16")        # inside shard_map: this rank's block"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ladder_jax.model import matvec, sharding


class Linear(nnx.Module):
    """`linear(x, dtype)` inside shard_map: `jnp.einsum(equation, x, w)` over this rank's block
    of `weight` read in `dtype` (`sharding.read_weight`), times `scale` (None for a float
    weight) after the contraction.

    `flat`: the product runs as one 2-D matmul (`flat_einsum`), the form XLA:CPU compiles
    fastest (CPU meshes). `kv_heads=(n_kv_heads, tp)`: the weight holds every kv head
    (replicated, n_kv_heads < tp) and each rank reads the one its query heads use, from the
    weight and its scale alike. `matmul="pallas"`: products over at most 16 rows run the
    Triton kernel (`small_m`), on GPU meshes only."""

    def __init__(
        self,
        weight: nnx.Param,
        equation: str,
        *,
        flat: bool = False,
        kv_heads: tuple[int, int] | None = None,
        matmul: str = "xla",
    ):
        self.weight = weight
        self.scale = None  # int8 weights: a float32 Param (`quant.quantize_linear`)
        self.equation = equation
        self.flat = flat
        self.kv_heads = kv_heads
        self.matmul = matmul

    @property
    def spec(self):
        """The weight's partition spec: how the model reads it, split over tp."""
        return self.weight.spec

    @property
    def contracted(self) -> tuple[int, ...]:
        """The weight's contracted (input) axes; the others are its output channels."""
        ins, out = self.equation.replace(" ", "").split("->")
        return tuple(i for i, c in enumerate(ins.split(",")[1]) if c not in out)

    def read(self, dtype=None):
        """This rank's block of the weight (its kv head: `kv_heads`), cast to `dtype`."""
        w = sharding.read_weight(self.weight, dtype)
        return w if self.kv_heads is None else sharding.local_kv_head(w, *self.kv_heads)

    def rescale(self, y):
        """`y`, the einsum over this weight's values, times its scale (float weights: `y`)."""
        if self.scale is None:
            return y
        s = sharding.read_weight(self.scale, jnp.float32)
        if self.kv_heads is not None:
            s = sharding.local_kv_head(s, *self.kv_heads)
        return rescale(y, self.equation, s)

    def __call__(self, x, dtype):
        """The product over this rank's block: through the Triton kernel where it runs
        (`small_m`), else `einsum`."""
        if self.matmul == "pallas":
            out = self.small_m(x, dtype)
            if out is not None:
                return out[0]
        return self.einsum(x, dtype)

    def einsum(self, x, dtype):
        """`jnp.einsum(equation, x, w)` (`flat`: as one 2-D matmul) times the scale: XLA's."""
        w = self.read(dtype)
        y = flat_einsum(self.equation, x, w) if self.flat else jnp.einsum(self.equation, x, w)
        return self.rescale(y)

    def small_m(
        self,
        x,
        dtype,
        interpret: bool = False,
        *,
        norm=None,
        gate_up=None,
        residual=None,
        joins: tuple = (),
        write: bool = True,
        swiglu: bool = False,
    ):
        """(y, stream) of the product through the Triton kernel (`matvec.small_m_matmul`: int8
        values and their scale go in as stored), or None where it does not apply (more than 16
        rows, shapes Triton cannot block, a float32 x without `norm`). stream is None unless
        `joins` are given. Folded in, each optional: `norm` (an `RMSNorm`): x is the float32
        stream, normalized first, after `joins` (reduced outputs, added in order) join it; the
        joined stream comes back unless `write=False`. `residual`: y is `residual + y` in
        float32. `gate_up=offset`: x's last axis holds the gate at `offset` and the up
        projection after it, and the kernel multiplies silu(gate) * up. `swiglu`: the weight's
        output columns are the gate's then the up projection's, and y is silu(gate) * up (half
        the columns)."""
        n = len(self.contracted)
        if not _is_flat(self.equation) or x.ndim < n:
            return None
        w = self.read(None if self.scale is not None else dtype)
        k, cols = math.prod(w.shape[:n]), w.shape[n:]
        rows = x.shape[: x.ndim - (1 if gate_up is not None else n)]
        m = math.prod(rows)
        if swiglu:
            cols = (math.prod(cols) // 2,)
        if matvec.plan(m, k, math.prod(cols), dtype, w.dtype) is None:
            return None
        x = x.reshape(m, -1)
        if norm is None and gate_up is None:
            x = x.astype(dtype)
        scale = None
        if self.scale is not None:
            scale = sharding.read_weight(self.scale, jnp.float32)
            if self.kv_heads is not None:
                scale = sharding.local_kv_head(scale, *self.kv_heads)
            scale = scale.reshape(-1)
        y = matvec.small_m_matmul(
            x,
            w.reshape(k, -1),
            scale,
            dtype=dtype,
            norm=None if norm is None else (sharding.read_weight(norm.scale), norm.eps),
            gate_up=gate_up,
            residual=None if residual is None else residual.reshape(m, -1),
            joins=tuple(j.reshape(m, -1) for j in joins) if joins else None,
            write_stream=write or not joins,
            swiglu=swiglu,
            interpret=interpret,
        )
        if y is None:
            return None
        if not joins:
            return y.reshape(*rows, *cols), None
        stream = None if y[1] is None else y[1].reshape(joins[0].shape)
        return y[0].reshape(*rows, *cols), stream


class FusedLinear(Linear):
    """Several linear layers that read one input, as one (D, C) weight split over `tp` by
    columns (`transformer.fuse_inputs`, for decoding): `fused(x, dtype)` is the (..., C)
    output, `split` gives each part's, part i shaped (..., *parts[i]). Its weight is a
    `FusedInput`."""

    def __init__(
        self, weight: nnx.Variable, parts: tuple[tuple[int, ...], ...], matmul: str = "xla"
    ):
        super().__init__(weight, "BTD,DC->BTC", matmul=matmul)
        self.parts = parts

    def split(self, y):
        """The parts of a (..., C) output, part i shaped (..., *parts[i])."""
        ends = np.cumsum([math.prod(p) for p in self.parts])[:-1].tolist()
        return tuple(
            y.reshape(*y.shape[:-1], *p) for y, p in zip(jnp.split(y, ends, axis=-1), self.parts)
        )

    def offset(self, part: int) -> int:
        """The column where part `part` starts in the (..., C) output."""
        return sum(math.prod(p) for p in self.parts[:part])


class FusedInput(nnx.Variable):
    """The weight of a `FusedLinear`: rank r's block holds its columns of each part in turn,
    each flattened. Not a `nnx.Param`: nothing trains or saves it."""


class FusesInputs(nnx.Module):
    """A module whose input projections decoding may fuse into one matmul (`install_fused`).
    `INPUTS`: the dotted attribute paths of those `Linear`s, in the fused weight's column
    order; `FUSED`: the attribute that then holds their `FusedLinear` (else None)."""

    INPUTS: tuple[str, ...] = ()
    FUSED: str = ""

    def input_linears(self) -> list[Linear]:
        return [_get(self, p) for p in self.INPUTS]

    def install_fused(self, fused: FusedLinear) -> None:
        """Decoding: `fused` (the `input_linears` concatenated, `transformer.fuse_inputs`)
        replaces the separate projections, which become None; the outputs are the same."""
        setattr(self, self.FUSED, nnx.data(fused))
        for p in self.INPUTS:
            owner, _, name = p.rpartition(".")
            setattr(_get(self, owner) if owner else self, name, None)


def _get(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def rescale(y, equation: str, scale):
    """`y`, the result of `jnp.einsum(equation, x, values)`, times the weight's scale (None:
    `y` unchanged). The scale's output axes must end `y`, in the weight's order (true of every
    einsum of the model)."""
    if scale is None:
        return y
    ins, out = equation.replace(" ", "").split("->")
    w_letters = ins.split(",")[1]
    kept = "".join(c for c in w_letters if c in out)
    assert out.endswith(kept), f"{equation}: the weight's output axes must end the result"
    s = scale.reshape([n for n, c in zip(scale.shape, w_letters) if c in out])
    return (y.astype(jnp.float32) * s).astype(y.dtype)


def _is_flat(equation: str) -> bool:
    """Whether `equation` is a linear layer's contraction (`flat_einsum`'s form)."""
    ins, out = equation.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    n = sum(1 for c in xs if c in ws)
    return xs[len(xs) - n :] == ws[:n] and out == xs[: len(xs) - n] + ws[n:]


def flat_einsum(equation: str, x, w):
    """`jnp.einsum(equation, x, w)` for a linear layer's equation (x's trailing axes contracted
    with w's leading ones, the result x's other axes then w's: "BTD,DNH->BTNH",
    "BTNH,NHD->BTD") as one (rows, in) x (in, out) matmul between reshapes. XLA:CPU compiles
    a 3-D einsum's weight gradient as a product of two transposed operands; this form's is
    one (in, rows) x (rows, out) product."""
    if not _is_flat(equation):
        raise ValueError(f"flat_einsum: {equation!r} is not a linear layer's contraction")
    xs, ws = equation.replace(" ", "").split("->")[0].split(",")
    n = sum(1 for c in xs if c in ws)  # contracted axes
    rows, cols = x.shape[: x.ndim - n], w.shape[n:]
    k = math.prod(x.shape[x.ndim - n :])
    y = x.reshape(-1, k) @ w.reshape(k, -1)
    return y.reshape(*rows, *cols)
