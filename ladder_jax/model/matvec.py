"""A Pallas (Triton) matmul for a few rows, y = x @ W reading each weight once (decoding), with
optional folds (RMSNorm, residual adds, silu(gate) * up) and int8 scales applied inside. The
spec: docs/architecture.md, 'The small-M matmul'.

    y_mn = small_m_matmul(x_mk, w_kn, scale_n)     # None where the shapes do not fit"""

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


def plan(m: int, k: int, n: int, x_dtype, w_dtype, tiles: int = 1) -> Plan | None:
    """The tiling for x (m, k) in `x_dtype` times W (k, n) in `w_dtype`, or None where the
    kernel does not apply (module doc): the caller then runs XLA's matmul. `tiles`: W tiles a
    program stages per step (2 for `swiglu`: its gate's and its up's)."""
    x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
    if not 1 <= m <= MAX_ROWS or x_dtype not in (jnp.bfloat16, jnp.float16):
        return None
    if w_dtype not in (x_dtype, jnp.int8):
        return None
    rows = 1 << (m - 1).bit_length()
    block_n = _pow2_factor(n, MAX_BLOCK_N)
    while block_n > MIN_BLOCK and n // block_n < TARGET_PROGRAMS:
        block_n //= 2
    cap = TILE_BYTES // (tiles * block_n * x_dtype.itemsize)
    if rows < DOT_ROWS:
        cap = min(cap, PRODUCT_ELEMENTS // (tiles * rows * block_n))
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


def _kernel(
    x_ref,
    w_ref,
    *rest,
    k,
    block_k,
    steps,
    dtype,
    scaled,
    dot,
    norm,
    gate_up,
    ends,
    joins,
    swiglu,
    write,
):
    """One (column block, split): x (rows, all columns), W (K / splits, block_n) (if `swiglu`
    (K / splits, 2, block_n): the gate's block and the up projection's), then the scale
    (block_n,) if `scaled` (`swiglu`: (2, block_n)), the norm's scale (K,) if `norm` (its
    eps), `joins` outputs (rows, K) to join x, the residual (rows, block_n) if `ends`; the
    output, then the joined stream (rows, K) if `write`. The split's rows of x are read at
    split * K / splits (plus `gate_up`: gate there, up K further); float32 sums, times the
    scale, out."""
    rest = list(rest)
    s_ref = rest.pop(0) if scaled else None
    n_ref = rest.pop(0) if norm is not None else None
    j_refs = [rest.pop(0) for _ in range(joins)]
    r_ref = rest.pop(0) if ends else None
    o_ref, *stream_ref = rest
    rows, cols = x_ref.shape[0], w_ref.shape[-1]
    base = pl.program_id(1) * (steps * block_k) + (gate_up or 0)

    def stream(at):  # the float32 stream, with the outputs that join it here, in order
        x = x_ref[:, pl.ds(at, block_k)].astype(jnp.float32)
        for j_ref in j_refs:
            x = x + j_ref[:, pl.ds(at, block_k)].astype(jnp.float32)
        return x

    if norm is not None:  # the row's mean square over all K columns, as `RMSNorm`
        eps = norm
        first = (pl.program_id(0) == 0) & (pl.program_id(1) == 0)

        def squares(i, acc):
            x = stream(i * block_k)
            if write:  # the first program writes the joined stream out

                @pl.when(first)
                def _():
                    stream_ref[0][:, pl.ds(i * block_k, block_k)] = x

            return acc + jnp.sum(x * x, axis=1)

        total = jax.lax.fori_loop(0, k // block_k, squares, jnp.zeros((rows,), jnp.float32))
        inv = jax.lax.rsqrt(total / k + eps)[:, None]

    def load_x(i):
        at = base + i * block_k
        if norm is not None:
            x = stream(at) * inv
            return (x * n_ref[pl.ds(at, block_k)].astype(jnp.float32)[None, :]).astype(dtype)
        x = x_ref[:, pl.ds(at, block_k)]
        if gate_up is not None:  # silu(gate) * up
            g = x.astype(jnp.float32)
            u = x_ref[:, pl.ds(at + k, block_k)]
            x = g / (1.0 + jnp.exp(-g)) * u.astype(jnp.float32)
        return x.astype(dtype)

    halves = (0, 1) if swiglu else (None,)  # swiglu: W's block is (K, gate | up, block_n)

    def product(x, i, half):
        at = pl.ds(i * block_k, block_k)
        w = (w_ref[at, :] if half is None else w_ref[at, half, :]).astype(dtype)
        if dot:
            return plgpu.dot(x, w)
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
        return jnp.sum(x[:, :, None] * w[None, :, :], axis=1)

    def body(i, accs):
        x = load_x(i)
        return tuple(a + product(x, i, h) for a, h in zip(accs, halves))

    zero = jnp.zeros((rows, cols), jnp.float32)
    accs = jax.lax.fori_loop(0, steps, body, tuple(zero for _ in halves))
    o_ref[...] = _epilogue(accs, halves, s_ref, r_ref, dtype).astype(o_ref.dtype)


def _epilogue(accs, halves, s_ref, r_ref, dtype):
    """The float32 sums times the scale (`s_ref`, None for float weights), silu(gate) * up of
    the two halves (`swiglu`: halves (0, 1)), plus the residual (`r_ref`, else None)."""
    if s_ref is not None:
        accs = tuple(
            a * (s_ref[...] if h is None else s_ref[h, :]).astype(jnp.float32)[None, :]
            for a, h in zip(accs, halves)
        )
    if len(halves) == 2:  # silu(gate) * up of the outputs as the unfused path rounds them
        g, u = (a.astype(dtype).astype(jnp.float32) for a in accs)
        acc = g / (1.0 + jnp.exp(-g)) * u
    else:
        acc = accs[0]
    if r_ref is not None:  # the residual stream plus the output as the unfused path rounds it
        acc = r_ref[...] + acc.astype(dtype).astype(jnp.float32)
    return acc


def small_m_matmul(
    x_mk,
    w_kn,
    scale_n=None,
    *,
    dtype=None,
    norm=None,
    gate_up: int | None = None,
    residual=None,
    joins=None,
    write_stream: bool = True,
    swiglu: bool = False,
    interpret: bool = False,
):
    """x (M, K) @ W (K, N) (times `scale_n` per column: int8 W) in `dtype` (default x's)
    through the Triton kernel, or None where `plan` says it does not apply. Inside shard_map
    the result is typed as varying like x and W (`vary_like`). Folded in, each optional:

    - `norm=(scale_k, eps)`: x is the float32 residual stream; the kernel multiplies
      `RMSNorm(x)` (`transformer.RMSNorm`: x * rsqrt(mean(x^2) + eps) * scale) in `dtype`.
    - `gate_up=offset`: x holds the gate (M, K) at column `offset` and the up projection's
      output right after it; the kernel multiplies silu(gate) * up (the MLP's down input).
    - `joins` (M, K), or a tuple of them added in order, with `norm`: outputs that join the
      stream first (the residual adds before a norm): the kernel multiplies
      `RMSNorm(x + joins)` and returns (y, the joined stream in float32, typed as the first
      of `joins`), the stream written by the first program; with `write_stream=False` it is
      not written and the second value is None (a later module joins the same outputs).
    - `residual` (M, N) float32: the result is `residual + y` in float32, y rounded to `dtype`
      first as the unfused sum rounds it (an output projection's residual add).
    - `swiglu`: W's first N/2 columns are the gate's, the rest the up projection's; the result
      (M, N/2) is silu(gate) * up of the two outputs rounded to `dtype`, in `dtype` (the MLP's
      down input). None where the contraction would split."""
    m = x_mk.shape[0]
    k, n = w_kn.shape
    dtype = jnp.dtype(dtype or x_mk.dtype)
    p = plan(m, k, n, dtype, w_kn.dtype, tiles=2 if swiglu else 1)
    width = x_mk.shape[1]
    if p is None or (width != k if gate_up is None else gate_up + 2 * k > width):
        return None
    if swiglu and (p.splits > 1 or (n // 2) % p.block_n or residual is not None):
        return None
    if norm is not None and (gate_up is not None or x_mk.dtype != jnp.float32):
        return None
    joins = None if joins is None else tuple(joins) if isinstance(joins, tuple) else (joins,)
    if joins is not None and (norm is None or any(j.shape != x_mk.shape for j in joins)):
        return None
    out = _call(
        x_mk,
        w_kn,
        scale_n,
        p,
        dtype,
        norm,
        gate_up,
        residual,
        joins,
        write_stream,
        swiglu,
        interpret,
    )
    return out if joins is None or write_stream else (out, None)


def _call(
    x_mk, w_kn, scale_n, p: Plan, dtype, norm, gate_up, residual, joins, write, swiglu, interpret
):
    m, width = x_mk.shape
    k, n = w_kn.shape
    rows = p.rows
    write = joins is not None and write

    def pad(a):
        return jnp.pad(a, ((0, rows - m), (0, 0))) if m < rows else a

    chunk = k // p.splits
    scaled = scale_n is not None
    ends = residual is not None and p.splits == 1
    kernel = functools.partial(
        _kernel,
        k=k,
        block_k=p.block_k,
        steps=chunk // p.block_k,
        dtype=dtype,
        scaled=scaled,
        dot=p.dot,
        norm=None if norm is None else float(norm[1]),
        gate_up=gate_up,
        ends=ends,
        joins=0 if joins is None else len(joins),
        swiglu=swiglu,
        write=write,
    )
    in_specs = [pl.BlockSpec((rows, width), lambda j, s: (0, 0))]
    args = [pad(x_mk)]
    if swiglu:  # the gate's and the up projection's columns as one (K, 2, N / 2) operand
        cols = n // 2
        in_specs.append(pl.BlockSpec((chunk, 2, p.block_n), lambda j, s: (s, 0, j)))
        args.append(w_kn.reshape(k, 2, cols))
    else:
        cols = n
        in_specs.append(pl.BlockSpec((chunk, p.block_n), lambda j, s: (s, j)))
        args.append(w_kn)
    if scaled:
        scale = scale_n.reshape(n).astype(jnp.float32)
        if swiglu:
            in_specs.append(pl.BlockSpec((2, p.block_n), lambda j, s: (0, j)))
            args.append(scale.reshape(2, cols))
        else:
            in_specs.append(pl.BlockSpec((p.block_n,), lambda j, s: (j,)))
            args.append(scale)
    if norm is not None:
        in_specs.append(pl.BlockSpec((k,), lambda j, s: (0,)))
        args.append(norm[0].reshape(k))  # as stored: the kernel reads it in float32
    for j_mk in joins or ():
        in_specs.append(pl.BlockSpec((rows, k), lambda j, s: (0, 0)))
        args.append(pad(j_mk))
    if ends:
        in_specs.append(pl.BlockSpec((rows, p.block_n), lambda j, s: (0, j)))
        args.append(pad(residual.astype(jnp.float32)))
    if p.splits == 1:
        out_spec = pl.BlockSpec((rows, p.block_n), lambda j, s: (0, j))
        out_dtype = jnp.float32 if ends else dtype
        out_shape = jax.ShapeDtypeStruct((rows, cols), out_dtype)
    else:
        out_spec = pl.BlockSpec((None, rows, p.block_n), lambda j, s: (s, 0, j))
        out_shape = jax.ShapeDtypeStruct((p.splits, rows, cols), jnp.float32)
    if write:
        out_spec = (out_spec, pl.BlockSpec((rows, k), lambda j, s: (0, 0)))
        out_shape = (out_shape, jax.ShapeDtypeStruct((rows, k), jnp.float32))
    call = pl.pallas_call(
        kernel,
        grid=(cols // p.block_n, p.splits),
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
        out = call(*args)
    y, joined = out if write else (out, None)
    y = _finish(vary_like(vary_like(y, x_mk), w_kn), m, rows, p, dtype, residual)
    return y if not write else (y, vary_like(joined[:m], joins[0]))


def _finish(y, m: int, rows: int, p: Plan, dtype, residual):
    """The kernel's output unpadded; where it split the contraction, the splits' sum (and the
    residual add) in one fusion."""
    if p.splits == 1:
        return y[:m] if m < rows else y
    y = y.sum(axis=0)[:m].astype(dtype)
    if residual is not None:
        y = residual.astype(jnp.float32) + y.astype(jnp.float32)
    return jax.lax.optimization_barrier(y)
