"""Decode attention over the filled slots of a KV cache only (a key-block loop, or a Pallas
kernel that with `attend_new` also runs RoPE and the cache write); forward only. The spec:
docs/architecture.md, 'Decode attention'.

    out_btnh = attend_filled(q_btnh, k_bkhs, v_bksh, q_pos_bt, kernel="matmul")"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ladder_jax.model.collectives import vary_like

KERNEL_NAME = "ragged_decode_attention"
MIN_BLOCK, MAX_BLOCK = 16, 512
# the most query rows (G x T) a Triton program holds: 1,024 rows of head_dim 128 ask for more
# shared memory than an H100 has (a deviceless compile refuses it); 64 compile
MAX_KERNEL_ROWS = 64


def key_block(slots: int) -> int:
    """Key slots per block for a cache of `slots`: a power of two from 16 to 512, about an
    eighth of the cache (so small caches still skip blocks, large ones loop a few times)."""
    return max(MIN_BLOCK, min(MAX_BLOCK, 1 << max(0, math.ceil(slots / 8) - 1).bit_length()))


def attend_filled(
    q_btnh,
    k_bkhs,
    v_bksh,
    q_pos_bt,
    kernel: str = "matmul",
    block: int | None = None,
    interpret: bool = False,
):
    """Attention of queries (B, T, N, H) at positions (B, T) over a cache of keys (B, K, H, S)
    and values (B, K, S, H) (`sharding.CACHE_BKSH`), reading only the blocks of slots some
    query can see (module doc). `kernel`: the model's `attention_kernel`; "pallas" or "cudnn"
    run the Triton kernel (`interpret=True`: through Pallas's interpreter, for tests) when a
    kv head's queries (its G query heads x T) fit one program's registers, MAX_KERNEL_ROWS:
    decode and speculative steps; a server's prompt chunks take the XLA loop."""
    S = v_bksh.shape[2]
    block = block or key_block(S)
    block = min(block, 1 << (S.bit_length() - 1))  # a power of two within the cache
    H = v_bksh.shape[3]
    rows = q_btnh.shape[1] * (q_btnh.shape[2] // k_bkhs.shape[1])
    # Triton's blocks: 16 or more slots, and a head width that is a power of two
    if (
        kernel in ("pallas", "cudnn")
        and S >= MIN_BLOCK
        and H == 1 << (H - 1).bit_length()
        and rows <= MAX_KERNEL_ROWS
    ):
        return _pallas(q_btnh, k_bkhs, v_bksh, q_pos_bt, block, interpret)
    return _blocked(q_btnh, k_bkhs, v_bksh, q_pos_bt, block)


def _grouped(q_btnh, K):
    """Queries (B, T, N, H) as (B, K, G*T, H): each kv head's G query heads times T."""
    B, T, N, H = q_btnh.shape
    G = N // K
    return q_btnh.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)


def _ungrouped(out_bkmh, T):
    B, K, M, H = out_bkmh.shape
    G = M // T
    return out_bkmh.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)


def _blocked(q_btnh, k_bkhs, v_bksh, q_pos_bt, block):
    """The XLA form: a while loop over key blocks up to the longest row's filled length."""
    K, S = k_bkhs.shape[1], v_bksh.shape[2]
    block = min(block, S)

    def fetch(i):
        # the last block may start early (a cache not a multiple of block): slots before
        # i * block were folded in already and are masked in `flash_loop`
        start = jnp.minimum(i * block, S - block)
        k_blk = jax.lax.dynamic_slice_in_dim(k_bkhs, start, block, axis=3)
        v_blk = jax.lax.dynamic_slice_in_dim(v_bksh, start, block, axis=2)
        return start, k_blk, v_blk

    n_blocks = (jnp.max(q_pos_bt) + block) // block  # ceil((max position + 1) / block)
    n_blocks = jnp.minimum(n_blocks, -(-S // block)).astype(jnp.int32)
    return flash_loop(q_btnh, q_pos_bt, fetch, n_blocks, block, K, v_bksh.dtype)


def flash_loop(q_btnh, q_pos_bt, fetch, n_blocks, block: int, K: int, dtype):
    """Flash attention's running softmax over `n_blocks` key blocks: `fetch(i)` gives block
    i's (first slot, keys (B, K, H, block), values (B, K, block, H)); slot s of it is seen by
    a query at position p iff i * block <= s <= p. Returns (B, T, N, H) in `dtype`."""
    B, T, N, H = q_btnh.shape
    q_bkmh = _grouped(q_btnh, K)
    M = q_bkmh.shape[2]
    G = M // T
    pos_bm = jnp.broadcast_to(q_pos_bt[:, None, :], (B, G, T)).reshape(B, 1, M, 1)
    batch = ((0, 1), (0, 1))
    scale = 1.0 / math.sqrt(H)

    def body(i, carry):
        m_bkm1, l_bkm1, acc_bkmh = carry
        start, k_blk, v_blk = fetch(i)
        s_bkms = (
            jax.lax.dot_general(
                q_bkmh, k_blk, (((3,), (2,)), batch), preferred_element_type=jnp.float32
            )
            * scale
        )
        slot = start + jnp.arange(block, dtype=jnp.int32)
        seen = (slot >= i * block)[None, None, None, :] & (slot[None, None, None, :] <= pos_bm)
        s_bkms = jnp.where(seen, s_bkms, -1e30)
        m_new = jnp.maximum(m_bkm1, s_bkms.max(-1, keepdims=True))
        p_bkms = jnp.exp(s_bkms - m_new)
        fix = jnp.exp(m_bkm1 - m_new)
        pv = jax.lax.dot_general(
            p_bkms.astype(v_blk.dtype),
            v_blk,
            (((3,), (2,)), batch),
            preferred_element_type=jnp.float32,
        )
        return m_new, l_bkm1 * fix + p_bkms.sum(-1, keepdims=True), acc_bkmh * fix + pv

    init = (
        jnp.full((B, K, M, 1), -1e30, jnp.float32),
        jnp.zeros((B, K, M, 1), jnp.float32),
        jnp.zeros((B, K, M, H), jnp.float32),
    )
    init = tuple(vary_like(x, q_btnh) for x in init)
    _, l_bkm1, acc_bkmh = jax.lax.fori_loop(0, n_blocks, body, init)
    return _ungrouped((acc_bkmh / l_bkm1).astype(dtype), T)


# ---------------------------------------------------------------------------------------------
# The Triton kernel.


SPLIT_PROGRAMS = 256  # programs a kernel aims for: about two per SM of an H100 (132)
PALLAS_BLOCK = 64  # key slots per Triton block: keys and values of a block stay in registers
# blocks a split covers at least: a split writes (and the combine reads back) its float32
# partial output for the kv head's M <= 16 query rows, at most 1/16 of what its 8 blocks of
# bf16 keys and values read, so splitting a short cache does not cost more bytes than it reads
SPLIT_MIN_BLOCKS = 8
MIN_ROWS = 16  # Triton's dot: at least 16 rows; fewer queries are loaded masked to 16


def _kernel(
    q_ref,
    pos_ref,
    k_ref,
    v_ref,
    o_ref,
    *lse_ref,
    block: int,
    rows: int,
    slots: int,
    per_split: int,
    scale: float,
    use_dot: bool,
):
    """One (row, kv head, split): queries (Mp, H) of which the first `rows` are real (the
    rest are masked out of every load and store), their positions (Mp,), keys (H, S),
    values (S, H). Split p folds in blocks p * per_split... of this row's filled blocks
    (those below max(pos) + 1) and writes its normalized output (Mp, H); with more than one
    split also its log-sum-exp (Mp,) (`lse_ref`), which `_pallas` combines the splits by."""
    Mp, H = q_ref.shape
    real = jnp.arange(Mp, dtype=jnp.int32) < rows
    q = plgpu.load(q_ref, mask=real[:, None], other=0).astype(jnp.float32)
    pos = plgpu.load(pos_ref, mask=real, other=0)
    filled_blocks = pl.cdiv(jnp.minimum(jnp.max(pos) + 1, slots), block)
    first = pl.program_id(2) * per_split
    last = jnp.maximum(first, jnp.minimum(first + per_split, filled_blocks))

    def body(i, carry):
        m, total, acc = carry
        start = jnp.minimum(i * block, slots - block)  # as in `_blocked`: never out of bounds
        slot = start + jnp.arange(block, dtype=jnp.int32)
        k = k_ref[:, pl.ds(start, block)].astype(jnp.float32)
        v = v_ref[pl.ds(start, block), :].astype(jnp.float32)
        if use_dot:
            s = plgpu.dot(q, k) * scale
        else:
            s = jnp.sum(q[:, :, None] * k[None, :, :], axis=1) * scale
        s = jnp.where((slot >= i * block)[None, :] & (slot[None, :] <= pos[:, None]), s, -1e30)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        fix = jnp.exp(m - m_new)
        if use_dot:
            pv = plgpu.dot(p, v)
        else:
            pv = jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return m_new, total * fix + p.sum(axis=1), acc * fix[:, None] + pv

    init = (
        jnp.full((Mp,), -1e30, jnp.float32),
        jnp.zeros((Mp,), jnp.float32),
        jnp.zeros((Mp, H), jnp.float32),
    )
    m, total, acc = jax.lax.fori_loop(first, last, body, init)
    seen = total > 0  # a split past the row's filled blocks saw nothing: weight 0
    out = acc / jnp.where(seen, total, 1.0)[:, None]
    plgpu.store(o_ref, out.astype(o_ref.dtype), mask=real[:, None])
    if lse_ref:
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -1e30)
        plgpu.store(lse_ref[0], lse, mask=real)


def _pallas(q_btnh, k_bkhs, v_bksh, q_pos_bt, block, interpret):
    """The Triton kernel over (B, K, splits). Each kv head's G query heads times T are its
    M = G*T query rows (at T = 1 the queries as they lie, no copy), read masked into the 16
    rows Triton's dot needs (no padded copy). The slots split so that B * K * splits is about
    `SPLIT_PROGRAMS` (flash decoding): one split writes the output where the output projection
    reads it; more write float32 partial outputs of the M real rows and their log-sum-exps,
    combined here."""
    B, T, N, H = q_btnh.shape
    K, S = k_bkhs.shape[1], v_bksh.shape[2]
    block = min(block, PALLAS_BLOCK)
    q_bkmh = _grouped(q_btnh, K)
    M = q_bkmh.shape[2]
    Mp = max(MIN_ROWS, 1 << (M - 1).bit_length())
    pos_bm = jnp.broadcast_to(q_pos_bt[:, None, :], (B, M // T, T)).reshape(B, M)
    pos_bm = pos_bm.astype(jnp.int32)
    blocks = -(-S // block)
    splits, per_split = _splits(blocks, B * K)
    use_dot = H >= 16 and H == 1 << (H - 1).bit_length()
    kernel = functools.partial(
        _kernel,
        block=block,
        rows=M,
        slots=S,
        per_split=per_split,
        scale=1.0 / math.sqrt(H),
        use_dot=use_dot,
    )
    out_specs, out_shape = _outputs(B, K, splits, M, Mp, H, v_bksh.dtype)
    call = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[
            pl.BlockSpec((None, None, Mp, H), lambda b, k, p: (b, k, 0, 0)),
            pl.BlockSpec((None, Mp), lambda b, k, p: (b, 0)),
            pl.BlockSpec((None, None, H, S), lambda b, k, p: (b, k, 0, 0)),
            pl.BlockSpec((None, None, S, H), lambda b, k, p: (b, k, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=KERNEL_NAME,
    )
    # its outputs carry no varying-manual-axes type, which shard_map's check refuses: run
    # with the check off and cast the results back to the queries' type
    with jax_config._check_vma(False):
        outs = [vary_like(x, q_btnh) for x in call(q_bkmh, pos_bm, k_bkhs, v_bksh)]
    if splits == 1:
        return _ungrouped(outs[0], T)
    return _ungrouped(_combine(*outs, v_bksh.dtype), T)


def _splits(blocks: int, programs: int) -> tuple[int, int]:
    """(splits, cache blocks per split) of a cache of `blocks` blocks read by `programs`
    (rows x kv heads) programs: enough splits to fill the GPU, none empty."""
    splits = max(1, min(blocks // SPLIT_MIN_BLOCKS, SPLIT_PROGRAMS // programs))
    per_split = -(-blocks // splits)
    return -(-blocks // per_split), per_split


def _outputs(B, K, splits, rows, Mp, H, dtype):
    """The kernels' output specs and shapes: with one split the normalized (B, K, rows, H)
    output in `dtype`; with several, each split's float32 output and log-sum-exp."""
    if splits == 1:
        specs = [pl.BlockSpec((None, None, Mp, H), lambda b, k, p: (b, k, 0, 0))]
        return specs, [jax.ShapeDtypeStruct((B, K, rows, H), dtype)]
    specs = [
        pl.BlockSpec((None, None, None, Mp, H), lambda b, k, p: (b, k, p, 0, 0)),
        pl.BlockSpec((None, None, None, Mp), lambda b, k, p: (b, k, p, 0)),
    ]
    shapes = [
        jax.ShapeDtypeStruct((B, K, splits, rows, H), jnp.float32),
        jax.ShapeDtypeStruct((B, K, splits, rows), jnp.float32),
    ]
    return specs, shapes


def _combine(o_bkprh, lse_bkpr, dtype):
    """The splits' partial outputs (axis 2) joined by their log-sum-exp weights; splits past
    a row's filled blocks hold log-sum-exp -1e30: their weight is 0."""
    w_bkpr = jnp.exp(lse_bkpr - lse_bkpr.max(axis=2, keepdims=True))
    return ((o_bkprh * w_bkpr[..., None]).sum(2) / w_bkpr.sum(2)[..., None]).astype(dtype)


# ---------------------------------------------------------------------------------------------
# The decode step's attention with RoPE and the cache write inside the kernel.


def writes_in_kernel(kernel: str, T: int, v_bksh) -> bool:
    """Whether `attend_new` runs for a step of T tokens per row over a values cache `v_bksh`:
    the Triton kernel ("pallas" / "cudnn"), one new token per row (a decode step), a cache of
    16 slots or more and a head width that is a power of two of 32 or more (each rotated half
    is a Triton block). Elsewhere the XLA ops (RoPE, `write_cache`) then `attend_filled`."""
    S, head_dim = v_bksh.shape[2:]
    return (
        kernel in ("pallas", "cudnn")
        and T == 1
        and S >= MIN_BLOCK
        and head_dim >= 32
        and head_dim == 1 << (head_dim - 1).bit_length()
    )


def attend_new(
    rows_bc, q_row: int, n_heads: int, pos_bt, inv_freq, k_bkhs, v_bksh, interpret=False
):
    """Decode attention of one new token per row from the q/k/v projection's output as it
    lies, RoPE and the cache write included, as one Triton kernel:

        out_btnh, (k_bkhs, v_bksh) = attend_new(rows_bc, 0, N, pos_bt, inv_freq, k, v)

    `rows_bc` (B, C), or (B, R, H) / (B, 1, C) (the same bytes): from column q_row * H on, the
    N = `n_heads` queries, then the K new keys, then the K new values, head by head, none
    rotated yet; columns past them (the parallel scheme's five-way projection: its gate and
    up, of any width) are never read, so the projection's output goes in whole, uncopied.
    `pos_bt` (B, 1) the token's position (< S); `inv_freq` (H/2,) RoPE's inverse frequencies
    (`attention.rope_frequencies`). Returns the attention output (B, 1, N, H) and the caches
    with the rotated key and the value written at slot pos[b] of row b, in place (the cache
    operands alias the outputs).

    Invariant: the same as rotating q and k (`attention.apply_rope`), writing the cache
    (`attention.write_cache`) and `attend_filled` over the written cache, to rounding. No
    program reads slot pos[b] from memory (the new token's key and value are folded in from
    registers by split 0, which alone writes them), so the splits never race."""
    B = rows_bc.shape[0]
    rows_bc = rows_bc.reshape(B, -1)
    C = rows_bc.shape[1]
    K, S, H = k_bkhs.shape[1], v_bksh.shape[2], v_bksh.shape[3]
    if (q_row + n_heads + 2 * K) * H > C:
        raise ValueError(f"{C} columns hold no {n_heads} + 2 x {K} heads of {H} from head {q_row}")
    G = n_heads // K
    Mp = max(MIN_ROWS, 1 << (G - 1).bit_length())
    block = min(key_block(S), PALLAS_BLOCK, 1 << (S.bit_length() - 1))
    blocks = -(-S // block)
    splits, per_split = _splits(blocks, B * K)
    kernel = functools.partial(
        _new_kernel,
        rows=G,
        q_row=q_row,
        k_row=q_row + n_heads,
        v_row=q_row + n_heads + K,
        block=block,
        slots=S,
        per_split=per_split,
        scale=1.0 / math.sqrt(H),
        use_dot=H // 2 >= 16,
        partial=splits > 1,
    )
    cache_specs = [
        pl.BlockSpec((None, None, H, S), lambda b, k, p: (b, k, 0, 0)),
        pl.BlockSpec((None, None, S, H), lambda b, k, p: (b, k, 0, 0)),
    ]
    cache_shapes = [
        jax.ShapeDtypeStruct(k_bkhs.shape, k_bkhs.dtype),
        jax.ShapeDtypeStruct(v_bksh.shape, v_bksh.dtype),
    ]
    out_specs, out_shape = _outputs(B, K, splits, G, Mp, H, rows_bc.dtype)
    n_out = len(out_shape)
    call = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[
            pl.BlockSpec((None, C), lambda b, k, p: (b, 0)),
            pl.BlockSpec((None, 1), lambda b, k, p: (b, 0)),
            pl.BlockSpec((H // 2,), lambda b, k, p: (0,)),
            *cache_specs,
        ],
        out_specs=out_specs + cache_specs,
        out_shape=out_shape + cache_shapes,
        input_output_aliases={3: n_out, 4: n_out + 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=KERNEL_NAME,
    )
    pos_b1 = pos_bt.astype(jnp.int32)
    with jax_config._check_vma(False):
        outs = call(rows_bc, pos_b1, inv_freq.astype(jnp.float32), k_bkhs, v_bksh)
        *outs, k_new, v_new = outs
        outs = [vary_like(x, rows_bc) for x in outs]
        cache = (vary_like(k_new, k_bkhs), vary_like(v_new, v_bksh))
    if splits == 1:
        return _ungrouped(outs[0], 1), cache
    return _ungrouped(_combine(*outs, rows_bc.dtype), 1), cache


def _rotate(x1, x2, cos, sin, dtype):
    """RoPE of the two halves of a head (`attention.apply_rope`), rounded to `dtype` as the
    XLA form stores them, back in float32."""
    r1 = (x1 * cos - x2 * sin).astype(dtype).astype(jnp.float32)
    r2 = (x2 * cos + x1 * sin).astype(dtype).astype(jnp.float32)
    return r1, r2


def _new_kernel(
    rows_ref,
    pos_ref,
    freq_ref,
    k_ref,
    v_ref,
    o_ref,
    *refs,
    rows: int,
    q_row: int,
    k_row: int,
    v_row: int,
    block: int,
    slots: int,
    per_split: int,
    scale: float,
    use_dot: bool,
    partial: bool,
):
    """One (row b, kv head, split) of `attend_new`: its `rows` query heads (loaded masked to
    Mp rows), rotated; the new key rotated and the new value, folded in first by split 0,
    which also writes them to slot pos of the caches (`refs`' last two, aliasing k_ref and
    v_ref); then this split's blocks of slots below pos, read from the cache."""
    lse_ref = refs[0] if partial else None
    k_out, v_out = refs[-2:]
    Mp, H = o_ref.shape[-2], o_ref.shape[-1]
    half = H // 2
    kh, split = pl.program_id(1), pl.program_id(2)
    real = jnp.arange(Mp, dtype=jnp.int32) < rows
    pos = jnp.max(pos_ref[...])
    angle = pos.astype(jnp.float32) * freq_ref[...]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    dtype = rows_ref.dtype
    # the row's columns are one flat run (their width need not be a multiple of H): this kv
    # head's query heads are Mp rows of H columns from column (q_row + kh * rows) * H
    q_col = (q_row + kh * rows + jnp.arange(Mp, dtype=jnp.int32))[:, None] * H
    cols = jnp.arange(half, dtype=jnp.int32)[None, :]
    q1 = plgpu.load(rows_ref.at[q_col + cols], mask=real[:, None], other=0)
    q2 = plgpu.load(rows_ref.at[q_col + half + cols], mask=real[:, None], other=0)
    q1, q2 = _rotate(q1.astype(jnp.float32), q2.astype(jnp.float32), cos, sin, dtype)
    k_col, v_col = (k_row + kh) * H, (v_row + kh) * H
    kr1 = rows_ref[pl.ds(k_col, half)].astype(jnp.float32)
    kr2 = rows_ref[pl.ds(k_col + half, half)].astype(jnp.float32)
    k1, k2 = _rotate(kr1, kr2, cos, sin, dtype)
    k1, k2 = (x.astype(k_ref.dtype).astype(jnp.float32) for x in (k1, k2))  # as the cache holds
    v_tok = rows_ref[pl.ds(v_col, H)].astype(v_ref.dtype)

    @pl.when(split == 0)
    def _():
        k_out[pl.ds(0, half), pos] = k1.astype(k_out.dtype)
        k_out[pl.ds(half, half), pos] = k2.astype(k_out.dtype)
        v_out[pos, :] = v_tok

    # the new token: its score and value start split 0's running softmax
    s_tok = (jnp.sum(q1 * k1[None, :], axis=1) + jnp.sum(q2 * k2[None, :], axis=1)) * scale
    mine = jnp.full((Mp,), split, jnp.int32) == 0
    m = jnp.where(mine, s_tok, -1e30)
    total = jnp.where(mine, 1.0, 0.0)
    acc = total[:, None] * v_tok.astype(jnp.float32)[None, :]
    filled_blocks = pl.cdiv(jnp.minimum(pos, slots), block)  # the slots below pos
    first = split * per_split
    last = jnp.maximum(first, jnp.minimum(first + per_split, filled_blocks))

    def body(i, carry):
        m, total, acc = carry
        start = jnp.minimum(i * block, slots - block)
        slot = start + jnp.arange(block, dtype=jnp.int32)
        ka = k_ref[pl.ds(0, half), pl.ds(start, block)].astype(jnp.float32)
        kb = k_ref[pl.ds(half, half), pl.ds(start, block)].astype(jnp.float32)
        v = v_ref[pl.ds(start, block), :].astype(jnp.float32)
        if use_dot:
            s = (plgpu.dot(q1, ka) + plgpu.dot(q2, kb)) * scale
        else:
            s = (
                jnp.sum(q1[:, :, None] * ka[None, :, :], axis=1)
                + jnp.sum(q2[:, :, None] * kb[None, :, :], axis=1)
            ) * scale
        s = jnp.where(((slot >= i * block) & (slot < pos))[None, :], s, -1e30)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        fix = jnp.exp(m - m_new)
        if use_dot:
            pv = plgpu.dot(p, v)
        else:
            pv = jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return m_new, total * fix + p.sum(axis=1), acc * fix[:, None] + pv

    m, total, acc = jax.lax.fori_loop(first, last, body, (m, total, acc))
    _store(o_ref, lse_ref, m, total, acc, real)


def _store(o_ref, lse_ref, m, total, acc, real):
    """The running softmax's output (its real rows), and its log-sum-exp where the splits'
    partials are combined afterwards (`lse_ref`, else None)."""
    seen = total > 0
    out = acc / jnp.where(seen, total, 1.0)[:, None]
    plgpu.store(o_ref, out.astype(o_ref.dtype), mask=real[:, None])
    if lse_ref is not None:
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -1e30)
        plgpu.store(lse_ref, lse, mask=real)
