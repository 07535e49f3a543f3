"""Decode attention over a paged KV cache as one Pallas (Triton) kernel; forward only. The spec:
docs/architecture.md, 'Decode attention'.

    out_btnh = attend_paged(q_btnh, k_pool, v_pool, table_bm, q_pos_bt)

The pools hold pages of `page` positions for every row: keys (P, K, H, page), values
(P, K, page, H); position p of row b lies in page table_bm[b, p // page] at offset p % page.
Each program (row, kv head, split) loops over its row's filled pages, one page a step, its id
read from the row's table: the pages a row never filled (and the trash page their table
entries point to) are never read. Splits and their combine are the contiguous kernel's
(`ragged`): flash decoding over the pages.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ladder_jax.model import ragged
from ladder_jax.model.collectives import vary_like

KERNEL_NAME = "paged_decode_attention"
# pages a split covers at least: as many slots as the contiguous kernel's smallest split
# (`ragged.SPLIT_MIN_BLOCKS` blocks of `ragged.PALLAS_BLOCK`), so its float32 partial output
# stays as small a fraction of the bytes it reads
MIN_SPLIT_SLOTS = ragged.SPLIT_MIN_BLOCKS * ragged.PALLAS_BLOCK


def _power_of_two(n: int) -> bool:
    return n >= 1 and n == 1 << (n - 1).bit_length()


def fits(q_btnh, k_pool) -> bool:
    """Whether `attend_paged` takes queries `q_btnh` (B, T, N, H) over keys `k_pool`
    (P, K, H, page): a kv head's query rows (G x T) within `ragged.MAX_KERNEL_ROWS`, a head
    width that is a power of two and pages of 16 slots or a larger power of two (Triton's
    blocks). Elsewhere the caller runs the XLA form."""
    _, T, N, H = q_btnh.shape
    K, page = k_pool.shape[1], k_pool.shape[3]
    return (
        N % K == 0
        and (N // K) * T <= ragged.MAX_KERNEL_ROWS
        and _power_of_two(H)
        and page >= ragged.MIN_BLOCK
        and _power_of_two(page)
    )


def attend_paged(q_btnh, k_pool, v_pool, table_bm, q_pos_bt, interpret: bool = False):
    """Attention of queries (B, T, N, H) at positions (B, T) over each row's pages: query at
    position p sees positions 0..p of its row (all of them real: the caller writes the new
    tokens' k/v into the pool first). Returns (B, T, N, H) in v_pool's dtype. A query at a
    negative position (a row not in use) attends to nothing: its output is zeros.

    `k_pool` (P, K, H, page), `v_pool` (P, K, page, H), `table_bm` (B, M) int32 page ids;
    `interpret=True` runs through Pallas's interpreter (tests). Only shapes `fits` accepts.

    Invariant: equal, to rounding, to gathering each row's pages into a contiguous cache and
    `ragged.attend_filled` over it. Slots past a query's position, in its row's last page, are
    masked out of the scores and their values zeroed before the product, so whatever they hold
    (another row's data, NaN) never reaches the output."""
    if not fits(q_btnh, k_pool):
        raise ValueError(
            f"the paged kernel does not take queries {q_btnh.shape} over keys {k_pool.shape}"
        )
    B, T, N, H = q_btnh.shape
    K, page = k_pool.shape[1], k_pool.shape[3]
    M = table_bm.shape[1]
    q_bkrh = ragged._grouped(q_btnh, K)
    rows = q_bkrh.shape[2]
    Mp = max(ragged.MIN_ROWS, 1 << (rows - 1).bit_length())
    pos_br = jnp.broadcast_to(q_pos_bt[:, None, :], (B, rows // T, T)).reshape(B, rows)
    splits, per_split = _splits(M, page, B * K)
    kernel = functools.partial(
        _kernel, rows=rows, per_split=per_split, scale=1.0 / math.sqrt(H), use_dot=H >= 16
    )
    out_specs, out_shape = ragged._outputs(B, K, splits, rows, Mp, H, v_pool.dtype)
    P = k_pool.shape[0]
    call = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[
            pl.BlockSpec((None, None, Mp, H), lambda b, k, p: (b, k, 0, 0)),
            pl.BlockSpec((None, Mp), lambda b, k, p: (b, 0)),
            pl.BlockSpec((None, M), lambda b, k, p: (b, 0)),
            pl.BlockSpec((P, None, H, page), lambda b, k, p: (0, k, 0, 0)),
            pl.BlockSpec((P, None, page, H), lambda b, k, p: (0, k, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=KERNEL_NAME,
    )
    args = (q_bkrh, pos_br.astype(jnp.int32), table_bm.astype(jnp.int32), k_pool, v_pool)
    # as in `ragged._pallas`: the outputs carry no varying-manual-axes type
    with jax_config._check_vma(False):
        outs = [vary_like(x, q_btnh) for x in call(*args)]
    if splits == 1:
        return ragged._ungrouped(outs[0], T)
    return ragged._ungrouped(ragged._combine(*outs, v_pool.dtype), T)


def _splits(pages: int, page: int, programs: int) -> tuple[int, int]:
    """(splits, pages per split) of a table of `pages` pages read by `programs` (rows x kv
    heads) programs: enough splits to fill the GPU, each of `MIN_SPLIT_SLOTS` or more, none
    empty."""
    min_pages = max(1, MIN_SPLIT_SLOTS // page)
    splits = max(1, min(pages // min_pages, ragged.SPLIT_PROGRAMS // programs))
    per_split = -(-pages // splits)
    return -(-pages // per_split), per_split


def _pages_read(split, top, page: int, pages: int, per_split: int):
    """The table entries [first, last) split `split` reads for a row whose queries' last
    position is `top`: its share of the pages holding positions 0..top (none where top < 0)."""
    filled = jnp.clip(pl.cdiv(top + 1, page), 0, pages)
    first = split * per_split
    return first, jnp.maximum(first, jnp.minimum(first + per_split, filled))


def _kernel(
    q_ref,
    pos_ref,
    table_ref,
    k_ref,
    v_ref,
    o_ref,
    *lse_ref,
    rows: int,
    per_split: int,
    scale: float,
    use_dot: bool,
):
    """One (row, kv head, split): queries (Mp, H) of which the first `rows` are real (the rest
    masked out of every load and store), their positions (Mp,), the row's page ids (M,), the
    pools of this kv head, keys (P, H, page) and values (P, page, H). Split p folds in pages
    p * per_split... of the row's filled pages (those holding a position <= max(pos)) and
    writes its normalized output (Mp, H), with several splits also its log-sum-exp (Mp,)."""
    Mp, H = q_ref.shape
    page = k_ref.shape[2]
    real = jnp.arange(Mp, dtype=jnp.int32) < rows
    q = plgpu.load(q_ref, mask=real[:, None], other=0).astype(jnp.float32)
    pos = plgpu.load(pos_ref, mask=real, other=-1)
    top = jnp.max(pos)
    first, last = _pages_read(pl.program_id(2), top, page, table_ref.shape[0], per_split)

    def body(i, carry):
        m, total, acc = carry
        page_id = table_ref[i]
        slot = i * page + jnp.arange(page, dtype=jnp.int32)
        k = k_ref[page_id, :, :].astype(jnp.float32)
        v = v_ref[page_id, :, :].astype(jnp.float32)
        v = jnp.where((slot <= top)[:, None], v, 0.0)  # past the row's end: never trusted
        if use_dot:
            s = plgpu.dot(q, k) * scale
        else:
            s = jnp.sum(q[:, :, None] * k[None, :, :], axis=1) * scale
        seen = slot[None, :] <= pos[:, None]
        s = jnp.where(seen, s, -1e30)
        m_new = jnp.maximum(m, s.max(axis=1))
        # zero where unseen: a query that sees nothing in this page keeps total 0
        p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
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
    ragged._store(o_ref, lse_ref[0] if lse_ref else None, m, total, acc, real)
