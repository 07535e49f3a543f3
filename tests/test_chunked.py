"""The server's programs for chunked prefill, prefix reuse and speculation (`Decoder.extend_slots`,
`copy_prefix`, `verify`) against independent references: the full forward `model(tokens)`, the
plain prefill (`prefill_slots`, flash attention from position 0) and plain decode steps; for
every residual scheme at tp 2 and those that differ at tp 1."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ladder_jax.inference import generation
from ladder_jax.inference.cache import KVCache
from ladder_jax.inference.generation import Decoder, rows_to_device, to_device, to_host
from ladder_jax.inference.sampling import RowSampling, Sampling
from tests.helpers import logits, tiny_model

SCHEMES = {
    "standard": dict(residual="standard"),
    "parallel": dict(residual="parallel"),
    "ladder": dict(residual="ladder"),
    "hybrid": dict(residual="ladder", ladder_layers=2),
    "desync": dict(residual="desync"),
    "upper_bound": dict(residual="upper_bound"),
}
# at tp 1 desync (one stream) and upper_bound (nothing to skip) are the standard model
CASES = [(n, 1) for n in ("standard", "parallel", "ladder", "hybrid")] + [(n, 2) for n in SCHEMES]
B, S, CHUNK = 3, 64, 8  # cache rows, positions, chunk tokens
PROMPTS = [[256] + [(7 * i + 3) % 250 for i in range(19)], [256] + list(range(40, 52))]  # 20, 13


@nnx.jit
def cached_logits(model, tokens_bt, positions_bt, cache):
    """The model's own (unfused) forward of tokens at positions against `cache`: logits."""
    return model.forward_cached(tokens_bt, positions_bt, cache.layers())[0]


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def case(request):
    name, tp = request.param
    model = tiny_model(tp, **SCHEMES[name])
    return model, Decoder(model)


def _dev(model, x):
    return to_device(np.asarray(x, np.int32), model.mesh, P())


def _rows(model, n, sampling=Sampling()):
    return rows_to_device(RowSampling.of([sampling] * n), model.mesh, P())


def _prefilled(model, decoder, prompts, slots, sampling=Sampling()):
    """A fresh cache with `prompts` prefilled the plain way into rows `slots` -> (first, cache)."""
    T = max(32, max(map(len, prompts)))
    tokens = np.zeros((len(prompts), T), np.int32)
    for n, p in enumerate(prompts):
        tokens[n, : len(p)] = p
    cache = KVCache.init(model.config, model.mesh, B, S)
    first, cache = decoder.prefill_slots(
        cache,
        _dev(model, slots),
        _dev(model, tokens),
        _dev(model, [len(p) for p in prompts]),
        _rows(model, len(prompts), sampling),
    )
    return to_host(first), cache


def _chunked(model, decoder, prompts, slots, cache=None, start=0):
    """`prompts` (their tokens from `start` on) extended into rows `slots` in chunks of CHUNK at
    increasing offsets, rows whose prompt is done riding as padding -> (first, cache)."""
    cache = cache if cache is not None else KVCache.init(model.config, model.mesh, B, S)
    first = [None] * len(prompts)
    offset = start
    while any(offset < len(p) for p in prompts):
        tokens = np.zeros((len(prompts), CHUNK), np.int32)
        lengths, slots_n = np.ones(len(prompts), np.int32), np.full(len(prompts), B, np.int32)
        for n, p in enumerate(prompts):
            part = p[offset : offset + CHUNK]
            if part:
                tokens[n, : len(part)], lengths[n], slots_n[n] = part, len(part), slots[n]
        out, cache = decoder.extend_slots(
            cache,
            _dev(model, slots_n),
            _dev(model, tokens),
            _dev(model, np.full(len(prompts), offset)),
            _dev(model, lengths),
            _rows(model, len(prompts)),
            _dev(model, np.zeros(len(prompts))),
        )
        out = to_host(out)
        for n, p in enumerate(prompts):
            if offset < len(p) <= offset + CHUNK:
                first[n] = int(out[n])
        offset += CHUNK
    return first, cache


def test_chunks_equal_the_plain_prefill_and_the_full_forward(case):
    """Two ragged prompts (20 and 13 tokens) in chunks of 8 at offsets 0, 8, 16 (the shorter
    one is padding in the last chunk): the first tokens are the full forward's greedy tokens and
    the plain prefill's; the next token's logits read from the chunked cache equal the full
    forward's over the prompt plus that token; the cache rows equal the plain prefill's."""
    model, decoder = case
    slots = [2, 0]
    plain_first, plain = _prefilled(model, decoder, PROMPTS, slots)
    first, cache = _chunked(model, decoder, PROMPTS, slots)
    for n, p in enumerate(PROMPTS):
        full = np.asarray(logits(model, np.array([p + [int(first[n])]], np.int32)))[0]
        assert first[n] == int(np.argmax(full[len(p) - 1])) == plain_first[n]
        nxt = cached_logits(
            model,
            np.array([[first[n]]], np.int32),
            np.array([[len(p)]], np.int32),
            _row(cache, slots[n]),
        )
        np.testing.assert_allclose(np.asarray(nxt)[0, 0], full[len(p)], atol=2e-4, rtol=1e-4)
        for got, want in [(cache.k, plain.k), (cache.v, plain.v)]:
            g, w = (np.asarray(x[0])[slots[n]] for x in (got, want))
            g, w = (x[..., : len(p)] if x.shape[-1] == S else x[..., : len(p), :] for x in (g, w))
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def _row(cache, slot):
    """Cache row `slot` alone (batch 1), as `forward_cached` takes it."""
    return KVCache(
        tuple(k[slot : slot + 1] for k in cache.k), tuple(v[slot : slot + 1] for v in cache.v)
    )


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, seed=5)])
def test_verify_equals_plain_decode_steps(case, sampling):
    """Row 0 drafts exactly the tokens plain decoding draws next, row 1 drafts wrong ones: the
    verify step's tokens equal the plain decode steps' wherever the drafts before them were
    right (all of row 0's, row 1's first), greedy and seeded (each position draws with the key of
    its token index)."""
    model, decoder = case
    K = 4
    slots = [0, 1]
    first, cache = _prefilled(model, decoder, PROMPTS, slots, sampling)
    rows = _rows(model, B, sampling)
    tokens, plain = np.zeros(B, np.int32), []
    tokens[slots] = first
    positions = np.zeros(B, np.int32)
    positions[slots] = [len(p) for p in PROMPTS]
    tok = tokens
    for j in range(K):
        tok, cache = decoder.decode_step(
            cache,
            _dev(model, tok),
            _dev(model, positions + j),
            rows,
            _dev(model, np.full(B, j + 1)),
        )
        tok = to_host(tok)
        plain.append(tok)
    plain = np.stack(plain, 1)  # (B, K): the tokens after the first
    _, cache = _prefilled(model, decoder, PROMPTS, slots, sampling)
    drafts = np.zeros((B, K), np.int32)
    drafts[:, 0] = tokens
    drafts[0, 1:] = plain[0, : K - 1]
    drafts[1, 1:] = (plain[1, : K - 1] + 1) % 250
    got, _ = decoder.verify(
        cache, _dev(model, drafts), _dev(model, positions), rows, _dev(model, np.ones(B))
    )
    got = to_host(got)
    np.testing.assert_array_equal(got[0], plain[0])
    assert got[1, 0] == plain[1, 0]


def test_copy_prefix_then_extend_equals_a_prefill_from_scratch(case):
    """Row 0 holds prompt A; row 2 holds another prompt. Copying A's first 16 positions into
    row 2 and extending row 2 by the 6 tokens of prompt B = A[:16] + 6 others gives B's first
    token and B's cache as a plain prefill of B; row 2's positions past B keep what they held
    before the copy."""
    model, decoder = case
    a = PROMPTS[0]
    b = a[:16] + [300, 301, 302, 303, 304, 305]
    other = [256] + list(range(100, 130))
    want_first, want = _prefilled(model, decoder, [b], [2])
    _, cache = _prefilled(model, decoder, [a, other], [0, 2])
    before = [np.asarray(x[0]).copy() for x in (cache.k, cache.v)]
    cache = decoder.copy_prefix(
        cache, _dev(model, [0, 0]), _dev(model, [2, B]), _dev(model, [16, 0])
    )
    first, cache = _chunked(model, decoder, [b], [2], cache, start=16)
    assert first[0] == want_first[0]
    for got, ref in [(cache.k, want.k), (cache.v, want.v)]:
        for layer in range(len(got)):
            g, w = np.asarray(got[layer])[2], np.asarray(ref[layer])[2]
            g, w = (x[..., : len(b)] if x.shape[-1] == S else x[..., : len(b), :] for x in (g, w))
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    end = 16 + CHUNK  # the chunk's padding writes reach this far
    np.testing.assert_array_equal(np.asarray(cache.v[0])[2][:, end:], before[1][2][:, end:])
    np.testing.assert_array_equal(np.asarray(cache.k[0])[0], before[0][0])  # the source row


def test_a_chunk_compiles_for_h100_and_a_verify_step_keeps_the_kernel():
    """Deviceless H100 compiles of attention over the cache: a 256-token chunk of 32 query
    heads over 8 kv heads (1,024 query rows a kv head, more than a Triton program's shared
    memory) takes the XLA loop and compiles; a verify step of 4 tokens keeps the kernel."""
    import jax
    import jax.numpy as jnp

    from ladder_jax.analysis import programs
    from ladder_jax.model import ragged

    mesh = programs.gpu_mesh("h100", 1)
    rep = jax.sharding.NamedSharding(mesh, P())

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    for T, kernel in [(256, False), (4, True)]:
        hlo = (
            jax.jit(lambda *a: ragged.attend_filled(*a, kernel="pallas"))
            .lower(
                arg((2, T, 32, 128)),
                arg((2, 8, 128, 1024)),
                arg((2, 8, 1024, 128)),
                arg((2, T), jnp.int32),
            )
            .compile()
            .as_text()
        )
        assert (ragged.KERNEL_NAME in hlo) == kernel, T


def test_an_idle_row_writes_at_its_frontier_and_changes_no_other_row(case):
    """A decode step (and a verify step) with row 2 idle at frontier p (position -(p + 1),
    `attend_rotated`'s convention): rows 0 and 1 draw exactly what they draw with row 2
    decoding at an ordinary position, row 2's slots below p keep the KV they held, and the
    step wrote from slot p on."""
    model, decoder = case
    slots, p = [0, 1], 5
    first, _ = _prefilled(model, decoder, PROMPTS, slots)
    rows = _rows(model, B)
    tokens = np.zeros(B, np.int32)
    tokens[slots] = first
    busy = np.array([len(q) for q in PROMPTS] + [0], np.int32)
    for verify in (False, True):
        out = {}
        for idle in (False, True):
            _, cache = _prefilled(model, decoder, PROMPTS + [PROMPTS[0][:12]], [0, 1, 2])
            before = [np.asarray(x) for x in (cache.k[0], cache.v[-1])]
            positions = busy.copy()
            positions[2] = -(p + 1) if idle else 12
            if verify:
                drafts = np.stack([tokens, tokens + 1, tokens + 2], 1).astype(np.int32)
                got, cache = decoder.verify(
                    cache, _dev(model, drafts), _dev(model, positions), rows, _dev(model, [1] * B)
                )
            else:
                got, cache = decoder.decode_step(
                    cache, _dev(model, tokens), _dev(model, positions), rows, _dev(model, [1] * B)
                )
            out[idle] = to_host(got)
            if idle:
                k, v = (np.asarray(x) for x in (cache.k[0], cache.v[-1]))
                np.testing.assert_array_equal(k[2][..., :p], before[0][2][..., :p])
                np.testing.assert_array_equal(v[2][:, :p], before[1][2][:, :p])
                assert not np.array_equal(k[2][..., p], before[0][2][..., p])
        np.testing.assert_array_equal(out[True][:2], out[False][:2])


def test_copy_prefix_moves_exactly_the_leading_slots_block_by_block():
    """copy_prefix on a random cache longer than its copy block (and not a multiple of it, so
    the last block overlaps the one before): each dst row's slots below its length are the src
    row's, everything else is untouched; a padding dst (past the cache) writes nothing."""
    model = tiny_model(2)
    decoder = Decoder(model)
    S = generation.COPY_BLOCK * 2 + 44
    shapes = KVCache.abstract(model.config, model.mesh, 4, S)
    rng = np.random.default_rng(0)

    def rand(x):
        return jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)

    cache = KVCache(tuple(map(rand, shapes.k)), tuple(map(rand, shapes.v)))
    before = [np.asarray(x) for x in (*cache.k, *cache.v)]
    src, dst, n = [0, 3, 1], [2, 1, 4], [S - 3, 17, 50]  # the last: padding (dst 4 of 4 rows)
    cache = decoder.copy_prefix(cache, _dev(model, src), _dev(model, dst), _dev(model, n))
    after = [np.asarray(x) for x in (*cache.k, *cache.v)]
    L = len(shapes.k)
    for i, (b, a) in enumerate(zip(before, after)):
        want = b.copy()
        for s_, d_, m in zip(src, dst, n):
            if d_ < 4:
                if i < L:  # keys (B, K, H, S)
                    want[d_][..., :m] = b[s_][..., :m]
                else:  # values (B, K, S, H)
                    want[d_][:, :m] = b[s_][:, :m]
        np.testing.assert_array_equal(a, want)
