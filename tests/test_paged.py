"""The paged KV cache (`PagedKV`, `ladder_jax.model.paged`) against the row cache (`KVCache`): the
same server programs (chunked prefill, plain prefill, decode steps, verify, scored steps) on a
pool whose pages are scattered at random give the same tokens, and every row's pages, gathered
by its table, hold what the row cache holds; rows sharing the pages of a common prefix decode
as a prefill from scratch would; for every residual scheme at tp 2 and those that differ at
tp 1."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ladder_jax.inference.cache import KVCache, PagedKV
from ladder_jax.inference.generation import Decoder, rows_to_device, to_device, to_host
from ladder_jax.inference.sampling import RowSampling, Sampling
from ladder_jax.model import paged
from tests.helpers import logits, tiny_model
from tests.test_chunked import CASES, SCHEMES

B, S, CHUNK, PAGE = 3, 64, 8, paged.PAGE
M = S // PAGE
PROMPTS = [[256] + [(7 * i + 3) % 250 for i in range(19)], [256] + list(range(40, 52))]  # 20, 13


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def case(request):
    name, tp = request.param
    model = tiny_model(tp, **SCHEMES[name])
    return model, Decoder(model)


def _dev(model, x, dtype=np.int32):
    return to_device(np.asarray(x, dtype), model.mesh, P())


def _rows(model, n, sampling=Sampling()):
    return rows_to_device(RowSampling.of([sampling] * n), model.mesh, P())


def _scattered(model, seed=0, extra=5):
    """A paged cache whose rows own random, disjoint pages (and page 0 nowhere) -> (cache,
    table)."""
    pages = B * M + extra
    rng = np.random.default_rng(seed)
    table = rng.permutation(np.arange(1, pages))[: B * M].reshape(B, M).astype(np.int32)
    cache = PagedKV.init(model.config, model.mesh, B, S, pages)
    return cache.with_table(_dev(model, table)), table


def gathered(cache: PagedKV, table, layer: int):
    """Layer `layer`'s keys (B, K, H, S) and values (B, K, S, H) gathered from the pools by
    `table`, in numpy: the row cache's layout."""
    k, v = np.asarray(cache.k[layer]), np.asarray(cache.v[layer])
    k_rows = k[table].transpose(0, 2, 3, 1, 4).reshape(B, k.shape[1], k.shape[2], -1)
    v_rows = v[table].transpose(0, 2, 1, 3, 4).reshape(B, v.shape[1], -1, v.shape[3])
    return k_rows, v_rows


def _script(model, decoder, cache, sampling):
    """Chunks of two prompts into rows 2 and 0, three decode steps, a verify step of 3 tokens,
    a plain prefill into row 1 and a scored decode step -> (every token drawn, cache, the
    positions each row has written)."""
    out, slots = [], [2, 0]
    first, offset = [0, 0], 0
    while any(offset < len(p) for p in PROMPTS):
        tokens = np.zeros((2, CHUNK), np.int32)
        lengths, slots_n = np.ones(2, np.int32), np.full(2, B, np.int32)
        for n, p in enumerate(PROMPTS):
            part = p[offset : offset + CHUNK]
            if part:
                tokens[n, : len(part)], lengths[n], slots_n[n] = part, len(part), slots[n]
        drawn, cache = decoder.extend_slots(
            cache,
            *(_dev(model, x) for x in (slots_n, tokens, np.full(2, offset), lengths)),
            _rows(model, 2, sampling),
            _dev(model, np.zeros(2)),
        )
        drawn = to_host(drawn)
        for n, p in enumerate(PROMPTS):
            if offset < len(p) <= offset + CHUNK:
                first[n] = int(drawn[n])
        offset += CHUNK
    out.append(first)
    rows = _rows(model, B, sampling)
    tok = np.zeros(B, np.int32)
    tok[slots] = first
    pos = np.full(B, -1, np.int32)  # row 1: idle, writing from 0, attending to nothing
    pos[slots] = [len(p) for p in PROMPTS]
    steps, cache = decoder.decode_steps(
        cache, _dev(model, tok), _dev(model, pos), rows, _dev(model, np.ones(B)), 3
    )
    steps = to_host(steps)
    out.append(steps.tolist())
    pos[slots] += 3
    drafts = np.zeros((B, 3), np.int32)
    drafts[:, 0] = steps[-1]
    drafts[:, 1:] = [[5, 6], [7, 8], [9, 10]]
    verified, cache = decoder.verify(
        cache, _dev(model, drafts), _dev(model, pos), rows, _dev(model, np.full(B, 4))
    )
    out.append(to_host(verified).tolist())
    third = [256, 11, 12, 13, 14, 15, 16]
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :7] = third
    first3, cache = decoder.prefill_slots(
        cache, _dev(model, [1]), _dev(model, tokens), _dev(model, [7]), _rows(model, 1, sampling)
    )
    out.append(to_host(first3).tolist())
    pos[slots] += 1  # the verify step's first token is now in, its drafts are not
    pos[1] = 7
    tok = to_host(verified)[:, 0].copy()
    tok[1] = to_host(first3)[0]
    scored, cache = decoder.decode_steps_scored(
        cache, _dev(model, tok), _dev(model, pos), rows, _dev(model, np.full(B, 5)), 1
    )
    out.append(to_host(scored[0]).tolist())
    out.append(np.round(to_host(scored[1]), 3).tolist())
    written = pos + 1
    return out, cache, written


SEEDED = [("ladder", 2), ("desync", 2), ("standard", 1)]  # where a seeded run is added


def test_pages_scattered_at_random_equal_rows(case):
    """The script's greedy tokens and every row's written KV are the row cache's."""
    _pages_equal_rows(*case, Sampling())


@pytest.mark.parametrize("case", SEEDED, indirect=True, ids=[f"{n}-tp{t}" for n, t in SEEDED])
def test_seeded_pages_equal_rows(case):
    """The same with sampling (each token drawn with its own key)."""
    _pages_equal_rows(*case, Sampling(temperature=1.0, seed=3))


def _pages_equal_rows(model, decoder, sampling):
    want, rows, written = _script(
        model, decoder, KVCache.init(model.config, model.mesh, B, S), sampling
    )
    cache, table = _scattered(model)
    got, cache, _ = _script(model, decoder, cache, sampling)
    assert got == want
    for layer in range(model.config.n_layers):
        k_rows, v_rows = gathered(cache, table, layer)
        for b in range(B):
            n = written[b]
            np.testing.assert_allclose(
                k_rows[b, ..., :n], np.asarray(rows.k[layer])[b, ..., :n], atol=1e-5, rtol=1e-5
            )
            np.testing.assert_allclose(
                v_rows[b, :, :n], np.asarray(rows.v[layer])[b, :, :n], atol=1e-5, rtol=1e-5
            )


def test_rows_sharing_a_prefix_page_decode_as_from_scratch(case):
    """Row 0 holds prompt A (20 tokens) in its pages; row 2's table starts with row 0's first
    page and goes on in its own: extending row 2 from position 16 by the rest of prompt B =
    A[:16] + 6 others draws the full forward's greedy token for B, and row 0's pages are left
    as they were."""
    model, decoder = case
    a = PROMPTS[0]
    b = a[:16] + [300, 301, 302, 303, 304, 305]
    cache, table = _scattered(model)
    table[2, 0] = table[0, 0]  # the shared page (row 2's own first page is never used)
    cache = cache.with_table(_dev(model, table))
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, : len(a)] = a
    _, cache = decoder.prefill_slots(
        cache, _dev(model, [0]), _dev(model, tokens), _dev(model, [len(a)]), _rows(model, 1)
    )
    before = np.asarray(cache.v[0])[table[0]].copy()
    tokens = np.zeros((1, CHUNK), np.int32)
    tokens[0, :6] = b[16:]
    drawn, cache = decoder.extend_slots(
        cache,
        *(_dev(model, x) for x in ([2], tokens, [16], [6])),
        _rows(model, 1),
        _dev(model, [0]),
    )
    full = np.asarray(logits(model, np.array([b], np.int32)))[0]
    assert int(to_host(drawn)[0]) == int(np.argmax(full[len(b) - 1]))
    np.testing.assert_array_equal(np.asarray(cache.v[0])[table[0]], before)


def test_writes_past_the_table_land_in_the_trash_page():
    """`paged.write` of positions past a row's table, and of rows whose entries are 0, touch
    page 0 only; the others land where the table says."""
    pool = np.zeros((4, 1, 2, 3), np.float32)  # keys (P, K, H, page) of pages of 3 slots
    table = np.array([[2, 3], [0, 0]], np.int32)  # row 1 owns nothing
    new = np.arange(2 * 3 * 1 * 2, dtype=np.float32).reshape(2, 3, 1, 2) + 1
    positions = np.array([[1, 3, 6], [0, 1, 2]], np.int32)  # 6: past row 0's 2 pages
    got = np.asarray(paged.write(jnp.asarray(pool), new, positions, table, keys=True))
    want = np.zeros_like(pool)
    want[2, :, :, 1] = new[0, 0]  # position 1: page table[0, 0] = 2, offset 1
    want[3, :, :, 0] = new[0, 1]  # position 3: page table[0, 1] = 3, offset 0
    np.testing.assert_array_equal(got[1:], want[1:])  # page 0 took the rest, in any order
