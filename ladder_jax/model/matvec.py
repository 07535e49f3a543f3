"""A Pallas (Triton) matmul for a few rows: y = x @ W that reads each weight once (decoding).

    y_mn = small_m_matmul(x_mk, w_kn, scale_n)     # None where the shapes do not fit

A decode step multiplies at most a few rows (one token per batch row) by every weight. Without
autotuning, XLA:GPU's split-K rewrite cuts such a GEMM's contraction into slices whose float32
partial products are written out and read back by the ops that follow; here each program reads
a block of W's columns (a slice of its rows too where the grid would otherwise be small),
accumulates in float32 registers and writes the output once:

- x (M, K) with M <= `MAX_ROWS` rows in bfloat16 / float16, padded to a power of two of
  rows; 16 rows go through Triton's dot, fewer through a broadcast multiply and sum (Triton's
  dot takes 16 rows or more: padding 1 row to 16 would move 16 times x's and the output's
  bytes); W (K, N) in x's dtype or int8, whose per-output-channel float32 `scale` (N,)
  multiplies the float32 sums inside the kernel; the output in x's dtype.
- the grid is (N / block_n, splits): `block_n` a power of two from 16 to 128 small enough for
  about `TARGET_PROGRAMS` programs; the contraction is split only where that is too few, and
  only while the splits' float32 partial outputs stay under 1/64 of W's bytes. One small XLA
  fusion sums them, behind an optimization barrier: left to itself XLA fuses the sum into
  each consumer (RoPE, both cache writes), and each reads the partials again.
- Triton blocks are powers of two: N and K must be multiples of 16, else (and for more rows,
  or a float32 x) `plan` says None and the caller runs XLA's matmul.

Deviceless H100 programs hold it as one `__gpu$xla.gpu.triton` custom call per linear layer
named `small_m_matmul`. Invariant: the result equals `(x @ W.astype(f32)) * scale` to the
rounding of the output dtype. Used by `Linear` when `ModelConfig.decode_matmul` is "pallas" on
GPU meshes; `interpret=True` runs it through Pallas's interpreter (tests on CPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ladder_jax.model.collectives import vary_like

KERNEL_NAME = "small_m_matmul"
MAX_ROWS = 16  # rows the kernel takes: decode's one token per batch row, up to 16 rows
DOT_ROWS = 16  # Triton's smallest dot; fewer rows are multiplied and summed in registers
MIN_BLOCK, MAX_BLOCK_N, MAX_BLOCK_K = 16, 128, 256
TILE_BYTES = 16384  # a (block_k, block_n) tile of W in the compute dtype: staged in shared memory
PRODUCT_ELEMENTS = 8192  # (rows, block_k, block_n) float32 products of the no-dot form
TARGET_PROGRAMS = 132  # at least one per SM of an H100 (132)
PARTIAL_SHARE = 64  # the splits' float32 partial outputs stay under 1/64 of W's bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernel's tiling of a (M, K) x (K, N) product: `rows` (M padded to a power of two),
    `block_n` columns and `block_k` rows of W per loop step, K cut into `splits` contiguous
    slices."""

    rows: int
    block_n: int
    block_k: int
    splits: int

    @property
    def dot(self) -> bool:
        return self.rows >= DOT_ROWS


def _pow2_factor(n: int, cap: int) -> int:
    """The largest power of two that divides `n`, at most `cap`."""
    return min(n & -n, cap)


def plan(m: int, k: int, n: int, x_dtype, w_dtype) -> Plan | None:
    """The tiling for x (m, k) in `x_dtype` times W (k, n) in `w_dtype`, or None where the
    kernel does not apply (module doc): the caller then runs XLA's matmul."""
    x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
    if not 1 <= m <= MAX_ROWS or x_dtype not in (jnp.bfloat16, jnp.float16):
        return None
    if w_dtype not in (x_dtype, jnp.int8):
        return None
    rows = 1 << (m - 1).bit_length()
    block_n = _pow2_factor(n, MAX_BLOCK_N)
    while block_n > MIN_BLOCK and n // block_n < TARGET_PROGRAMS:
        block_n //= 2
    cap = TILE_BYTES // (block_n * x_dtype.itemsize)
    if rows < DOT_ROWS:
        cap = min(cap, PRODUCT_ELEMENTS // (rows * block_n))
    block_k = _pow2_factor(k, min(MAX_BLOCK_K, cap))
    if block_n < MIN_BLOCK or block_k < MIN_BLOCK:
        return None
    steps, splits = k // block_k, 1
    max_splits = k * w_dtype.itemsize // (PARTIAL_SHARE * rows * 4)  # partials vs W's bytes
    while (
        (n // block_n) * splits < TARGET_PROGRAMS
        and steps % (2 * splits) == 0
        and 2 * splits <= max_splits
    ):
        splits *= 2
    return Plan(rows, block_n, block_k, splits)


def _kernel(x_ref, w_ref, *rest, block_k: int, steps: int, scaled: bool, dot: bool):
    """One (column block, split): x (rows, K / splits), W (K / splits, block_n), the scale
    (block_n,) if `scaled`; float32 sums over the split's rows of W, times the scale, out."""
    s_ref, o_ref = rest if scaled else (None, rest[0])
    rows, cols = x_ref.shape[0], w_ref.shape[1]

    def body(i, acc):
        x = x_ref[:, pl.ds(i * block_k, block_k)]
        w = w_ref[pl.ds(i * block_k, block_k), :].astype(x.dtype)
        if dot:
            return acc + plgpu.dot(x, w)
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
        return acc + jnp.sum(x[:, :, None] * w[None, :, :], axis=1)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, cols), jnp.float32))
    if scaled:
        acc = acc * s_ref[...].astype(jnp.float32)[None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


def small_m_matmul(x_mk, w_kn, scale_n=None, *, interpret: bool = False):
    """x (M, K) @ W (K, N) (times `scale_n` per column: int8 W) in x's dtype through the
    Triton kernel, or None where `plan` says it does not apply. Inside shard_map the result is
    typed as varying like x (`vary_like`)."""
    m, k = x_mk.shape
    n = w_kn.shape[1]
    p = plan(m, k, n, x_mk.dtype, w_kn.dtype)
    if p is None or w_kn.shape[0] != k:
        return None
    return _call(x_mk, w_kn, scale_n, p, interpret)


def _call(x_mk, w_kn, scale_n, p: Plan, interpret: bool):
    m, k = x_mk.shape
    n, rows = w_kn.shape[1], p.rows
    x_pk = jnp.pad(x_mk, ((0, rows - m), (0, 0))) if m < rows else x_mk
    chunk = k // p.splits
    scaled = scale_n is not None
    kernel = functools.partial(
        _kernel, block_k=p.block_k, steps=chunk // p.block_k, scaled=scaled, dot=p.dot
    )
    in_specs = [
        pl.BlockSpec((rows, chunk), lambda j, s: (0, s)),
        pl.BlockSpec((chunk, p.block_n), lambda j, s: (s, j)),
    ]
    args = [x_pk, w_kn]
    if scaled:
        in_specs.append(pl.BlockSpec((p.block_n,), lambda j, s: (j,)))
        args.append(scale_n.reshape(n).astype(jnp.float32))
    if p.splits == 1:
        out_spec = pl.BlockSpec((rows, p.block_n), lambda j, s: (0, j))
        out_shape = jax.ShapeDtypeStruct((rows, n), x_mk.dtype)
    else:
        out_spec = pl.BlockSpec((None, rows, p.block_n), lambda j, s: (s, 0, j))
        out_shape = jax.ShapeDtypeStruct((p.splits, rows, n), jnp.float32)
    call = pl.pallas_call(
        kernel,
        grid=(n // p.block_n, p.splits),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name=KERNEL_NAME,
    )
    # its output carries no varying-manual-axes type, which shard_map's check refuses: run
    # with the check off and type the result as x is
    with jax_config._check_vma(False):
        y = vary_like(call(*args), x_mk)
    if p.splits > 1:
        y = jax.lax.optimization_barrier(y.sum(axis=0).astype(x_mk.dtype))
    return y[:m] if m < rows else y
