"""The paged KV cache's arithmetic (the server's cache): per layer a pool of pages of `page`
positions, keys (P, K, H, page) and values (P, K, page, H), and a block table (B, M) int32:
position p of row b lives in page table[b, p // page] at offset p % page. Page 0 is the trash
page: table entries not handed out point to it, so a write past what a row owns lands there
and is never read as real data (every read is masked by position). The layout and who hands
out pages: docs/architecture.md, 'The paged KV cache'.

    pool = write(pool, new_btkh, positions_bt, table_bm, keys=True)
    out_btnh = attend(q_btnh, k_pool, v_pool, table_bm, q_pos_bt)"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ladder_jax.model import paged_kernel, ragged

PAGE = 16  # positions per page: the prefix cache's block, Triton's smallest dot


def page_of(positions_bt, table_bm, page: int):
    """(page ids, offsets) of positions (B, T) >= 0: past the table's end, the trash page."""
    index_bt = positions_bt // page
    pages_bt = jnp.take_along_axis(table_bm, index_bt, axis=1, mode="fill", fill_value=0)
    return pages_bt, positions_bt % page


def write(pool, new_btkh, positions_bt, table_bm, *, keys: bool):
    """Writes row b's entry t (K, H) at position positions_bt[b, t] >= 0 of its pages, in place
    (under donation): keys into (P, K, H, page), values into (P, K, page, H)."""
    page = pool.shape[3] if keys else pool.shape[2]
    pages_bt, offsets_bt = page_of(positions_bt, table_bm, page)
    B, T, K, H = new_btkh.shape
    new_xkh = new_btkh.reshape(B * T, K, H).astype(pool.dtype)
    pages_x, offsets_x = pages_bt.reshape(-1), offsets_bt.reshape(-1)
    if keys:
        return pool.at[pages_x, :, :, offsets_x].set(new_xkh, mode="drop")
    return pool.at[pages_x, :, offsets_x, :].set(new_xkh, mode="drop")


def attend(q_btnh, k_pool, v_pool, table_bm, q_pos_bt, kernel: str = "matmul"):
    """Attention of queries (B, T, N, H) at positions (B, T) over their rows' pages: query at
    position p sees positions 0..p of its row; a negative position sees nothing. `kernel`: the
    model's `attention_kernel`; "pallas" or "cudnn" run the Triton kernel
    (`paged_kernel.attend_paged`: each row reads its own filled pages) where it `fits` (decode
    and verify steps), else the XLA form: a loop over blocks of pages up to the furthest
    position in the batch, each block gathered from the pool by the table
    (`ragged.flash_loop`)."""
    if kernel in ("pallas", "cudnn") and paged_kernel.fits(q_btnh, k_pool):
        return paged_kernel.attend_paged(q_btnh, k_pool, v_pool, table_bm, q_pos_bt)
    B = q_btnh.shape[0]
    K, page = k_pool.shape[1], k_pool.shape[3]
    M = table_bm.shape[1]
    per = max(1, min(M, ragged.key_block(M * page) // page))  # pages per block
    blocks = -(-M // per)
    table_bm = jnp.pad(table_bm, ((0, 0), (0, blocks * per - M)))  # trash past the end
    block = per * page

    def fetch(i):
        ids_bp = jax.lax.dynamic_slice_in_dim(table_bm, i * per, per, axis=1)
        k_bpkhs = jnp.take(k_pool, ids_bp, axis=0)  # (B, per, K, H, page)
        v_bpksh = jnp.take(v_pool, ids_bp, axis=0)  # (B, per, K, page, H)
        k_bkhs = k_bpkhs.transpose(0, 2, 3, 1, 4).reshape(B, K, -1, block)
        v_bksh = v_bpksh.transpose(0, 2, 1, 3, 4).reshape(B, K, block, -1)
        return i * block, k_bkhs, v_bksh

    n_blocks = jnp.minimum((jnp.max(q_pos_bt) + block) // block, blocks).astype(jnp.int32)
    return ragged.flash_loop(q_btnh, q_pos_bt, fetch, n_blocks, block, K, v_pool.dtype)
