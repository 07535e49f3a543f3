"""The serving engine in-process (no HTTP) with its paged KV cache, chunked prefill, prefix caching,
preemption and speculative decoding, against `generate` (a row cache, plain prefill, one token
per step, no reuse): every request's tokens equal its offline tokens, greedy for several schemes
at tp 1 and 2, seeded sampling too."""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ladder_jax.cli import serve
from ladder_jax.inference import generation
from ladder_jax.inference.batching import Engine, Request
from ladder_jax.inference.cache import KVCache
from ladder_jax.inference.generation import rows_to_device, to_device
from ladder_jax.inference.pages import PagePool
from ladder_jax.inference.plan import VERIFY, Plan
from ladder_jax.inference.sampling import GenerationError, RowSampling, Sampling
from tests.helpers import cli_error, tiny_model

CASES = [(n, 1) for n in ("standard", "ladder", "parallel")] + [
    (n, 2) for n in ("standard", "ladder", "parallel", "desync")
]
SHARED = [256] + [(11 * i + 5) % 200 for i in range(23)]  # a 24-token "system prompt"
LOOP = [256] + [30, 31, 32, 33, 34, 35] * 5  # repetitive: drafts find their n-grams


def _tail(seed, n):
    return [(seed * 37 + 13 * i) % 250 for i in range(n)]


# phases of requests (prompt, max_tokens): each phase starts when the one before has finished,
# so its requests find the rows of the earlier ones released (their prefixes reusable)
PHASES = [
    [(SHARED + _tail(1, 12), 10), (_tail(2, 19), 8)],
    [
        (SHARED + _tail(3, 5), 12),  # reuses the released pages of the first request
        (SHARED + _tail(4, 9), 9),  # admitted with it: shares the same pages
        (LOOP, 16),
        (_tail(5, 33), 6),
        (_tail(6, 26), 7),  # five prompts, three slots: rows are evicted, requests wait
    ],
    [(SHARED + _tail(1, 12), 10), (LOOP[:20] + _tail(7, 3), 12)],
]


def _run(engine, phases, sampling=Sampling()):
    """Each phase's requests submitted together, the next once they all finished -> tokens of
    every request in order, their finish reasons and the requests."""
    got, reasons, reqs = [], [], []
    engine.start()
    try:
        for phase in phases:
            done = threading.Semaphore(0)
            for prompt, m in phase:
                out, k = [], len(reasons)
                reasons.append(None)

                def finish(why, k=k):
                    reasons[k] = why
                    done.release()

                got.append(out)
                reqs.append(
                    Request(prompt, m, sampling=sampling, on_token=out.append, on_finish=finish)
                )
                engine.submit(reqs[-1])
            for _ in phase:
                assert done.acquire(timeout=180), (reasons, engine.error)
    finally:
        engine.drain(5)
    return got, reasons, reqs


def _shared_pages(engine):
    """The largest number of rows that held one page at once, after each planned round."""
    most = [0]
    plan = engine._plan

    def recorded():
        p = plan()
        held = [pg for pages in engine.held for pg in pages]
        most[0] = max([most[0]] + [held.count(pg) for pg in set(held)])
        return p

    engine._plan = recorded
    return most


def _idle_positions(engine):
    """The positions every planned round gave its rows that were not decoding."""
    seen = []
    plan = engine._plan

    def recorded():
        p = plan()
        if p.decode:
            seen.extend(int(x) for x in p.positions_b[~p.busy_b])
        return p

    engine._plan = recorded
    return seen


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_chunked_prefix_cached_speculative_engine_equals_generate(name, tp):
    """3 slots, chunks of 8 (prompts of up to 36 tokens: up to 5 chunks, ragged), pages of 4
    and 3 drafted tokens: every request's greedy tokens equal `generate`'s; the shared prefix
    was reused (released pages, and pages two rows held at once), drafts were accepted; a last
    request continuing an earlier one's prompt and answer (a chat history) reuses the
    answer's KV too."""
    model = tiny_model(tp, residual=name)
    requests = [r for phase in PHASES for r in phase]
    want = generation.generate(model, [p for p, _ in requests], max_new_tokens=16)
    history = requests[-1][0] + want[-1][: requests[-1][1]] + [9]  # the last one's chat turn
    want += generation.generate(model, [history], max_new_tokens=4)
    requests.append((history, 4))  # ends a block: were its unfed last token counted, it shows
    engine = Engine(
        model, slots=3, max_len=64, prefills_per_step=1, chunk=8, prefix_block=4, speculate=3
    )
    idle = _idle_positions(engine)
    shared = _shared_pages(engine)
    got, reasons, reqs = _run(engine, [*PHASES, [(history, 4)]])
    assert reasons == ["length"] * len(requests)
    assert got == [w[:m] for w, (_, m) in zip(want, requests)]
    # rows not decoding went in idle, writing at their frontier inside the rows' lengths, never
    # at the cache's end (where every decode step's attention would read the whole cache)
    assert idle and all(-engine.length <= p < 0 for p in idle), idle
    assert engine.prefix_hit_tokens >= 2 * 24 and shared[0] >= 2
    assert reqs[-1].cached_tokens == (len(history) - 1) // 4 * 4  # all but the new token
    assert engine.drafted_tokens > 0 and engine.drafted_tokens >= engine.accepted_tokens
    # whether a tiny random model repeats one of its n-grams before its max_tokens, where a
    # draft could be accepted, depends on where the rounds fall; these models do
    if name != "desync":
        assert engine.accepted_tokens > 0
    _check_registered_kv(engine)


def _chain_tokens(pool: PagePool, cid: int) -> list[int]:
    """The whole token prefix a chain id stands for (its blocks, first to last)."""
    blocks = []
    while cid:
        cid, block = pool._key[cid]
        blocks.append(list(block))
    return [t for block in reversed(blocks) for t in block]


def _check_registered_kv(engine):
    """Every page the pool has registered for a prefix (generated tokens and accepted drafts
    included, never a rejected draft's position) holds the KV a plain prefill of that prefix
    writes at its positions."""
    pool, page = engine.pool, engine.page
    chains = [(pg, _chain_tokens(pool, cid)) for cid, pg in pool._owner.items()]
    assert any(len(t) > 24 for _, t in chains), chains
    mesh, rep, T = engine.mesh, P(), 64
    for start in range(0, len(chains), engine.slots):
        part = chains[start : start + engine.slots]
        tokens = np.zeros((len(part), T), np.int32)
        for n, (_, t) in enumerate(part):
            tokens[n, : len(t)] = t
        fresh = KVCache.init(engine.config, mesh, len(part), T)
        _, fresh = engine.decoder.prefill_slots(
            fresh,
            to_device(np.arange(len(part), dtype=np.int32), mesh, rep),
            to_device(tokens, mesh, rep),
            to_device(np.array([len(t) for _, t in part], np.int32), mesh, rep),
            rows_to_device(RowSampling.empty(len(part)), mesh, rep),
        )
        for layer in range(engine.config.n_layers):
            k_pool, v_pool = np.asarray(engine.cache.k[layer]), np.asarray(engine.cache.v[layer])
            k_rows, v_rows = np.asarray(fresh.k[layer]), np.asarray(fresh.v[layer])
            for n, (pg, t) in enumerate(part):
                at = slice(len(t) - page, len(t))
                np.testing.assert_allclose(k_pool[pg], k_rows[n][..., at], atol=1e-4, rtol=1e-4)
                np.testing.assert_allclose(v_pool[pg], v_rows[n][:, at], atol=1e-4, rtol=1e-4)


def test_chunks_alone_without_the_prefix_cache_equal_generate():
    """`--no-prefix-cache`, no speculation: chunks of 8 only; the same tokens as `generate`,
    nothing reused, no page shared, nothing counted."""
    model = tiny_model(2, residual="ladder")
    requests = [r for phase in PHASES for r in phase]
    want = generation.generate(model, [p for p, _ in requests], max_new_tokens=16)
    engine = Engine(model, slots=3, max_len=64, prefills_per_step=1, chunk=8, prefix_block=None)
    shared = _shared_pages(engine)
    got, reasons, reqs = _run(engine, PHASES)
    assert got == [w[:m] for w, (_, m) in zip(want, requests)]
    assert shared[0] == 1 and engine.prefix_queried_tokens == 0 and engine.drafted_tokens == 0
    assert {r.cached_tokens for r in reqs} == {0}


def test_seeded_sampling_with_speculation_equals_generate():
    """Sampled tokens (temperature 0.5, top_k 3, a seed) through chunks, reused prefixes and
    verify steps are `generate`'s with the same seed: each token drawn with its own key."""
    model = tiny_model(1, residual="ladder")
    sampling = Sampling(temperature=0.5, top_k=3, seed=7)
    requests = [r for phase in PHASES[:2] for r in phase]
    want = [
        generation.generate(model, [p], max_new_tokens=16, sampling=sampling)[0]
        for p, _ in requests
    ]
    engine = Engine(
        model, slots=3, max_len=64, prefills_per_step=1, chunk=8, prefix_block=4, speculate=3
    )
    got, _, _ = _run(engine, PHASES[:2], sampling)
    assert got == [w[:m] for w, (_, m) in zip(want, requests)]
    assert engine.accepted_tokens > 0
    _check_registered_kv(engine)


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--prefill-chunk", "0", "--prefill-chunk 0: must be >= 1"),
        ("--prefill-chunk", "-5", "--prefill-chunk -5: must be >= 1"),
        ("--speculate", "-1", "--speculate -1: must be >= 0"),
    ],
)
def test_bad_serving_flags_are_one_line(capsys, flag, value, message):
    assert message in cli_error(capsys, serve.main, ["--preset", "tiny", flag, value])


def test_engine_refuses_bad_settings():
    model = tiny_model(1)
    for kw, words in [
        (dict(chunk=0), "chunk must be >= 1"),
        (dict(speculate=-1), "speculate must be >= 0"),
        (dict(prefix_block=0), "prefix_block must be >= 1"),
    ]:
        with pytest.raises(GenerationError, match=words):
            Engine(model, slots=1, max_len=16, **kw)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, top_k=5, seed=11)])
def test_preempted_requests_resume_with_the_same_tokens(sampling):
    """Four requests sharing a 24-token prefix, 20 new tokens each, over a pool of 22 pages of
    4 positions (each request grows to 14 pages, 6 of them shared): the pool runs out, the
    newest requests are preempted and resumed with what they had produced as prompt; every
    request's tokens still equal `generate`'s (greedy and seeded: each token drawn with its
    own key) and every page is back in the pool at the end."""
    model = tiny_model(1, residual="ladder")
    requests = [(SHARED + _tail(k, 10), 20) for k in range(4)]
    want = [
        generation.generate(model, [p], max_new_tokens=m, sampling=sampling)[0] for p, m in requests
    ]
    engine = Engine(
        model, slots=3, max_len=64, prefills_per_step=1, chunk=8, prefix_block=4, pages=23
    )
    got, reasons, _ = _run(engine, [requests], sampling)
    assert reasons == ["length"] * 4
    assert got == want
    assert engine.preemptions > 0
    assert engine.pool.available() == engine.pool.capacity
    engine.pool.check()


def test_serving_after_the_warm_up_compiles_nothing():
    """The warm-up runs no program, only compiles them; a request whose prompt fits the warmed
    chunk bucket (12 tokens: chunks of 8 and 4, both padded to 8), decoded with drafts, then
    compiles nothing:
    jax reuses the warm-up's programs (counted from jax's compile events), and its tokens are
    `generate`'s."""
    model = tiny_model(1, residual="ladder")
    prompt = LOOP[:12]
    want = generation.generate(model, [prompt], max_new_tokens=6)[0]
    engine = Engine(
        model, slots=2, max_len=64, prefills_per_step=1, chunk=8, prefix_block=4, speculate=2
    )
    assert engine.warmup_programs() == [(1, 8), (2, 8), (2, 0)]  # chunks of 8, the decode round
    engine.warmup()
    compiled = []

    def listener(name, secs, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            compiled.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        got, reasons, _ = _run(engine, [[(prompt, 6)]])
        B = engine.slots  # a verify step as the engine runs one (whether or not drafts came)
        drafts = Plan(
            True, VERIFY, *(np.zeros(B, np.int32),) * 2, RowSampling.empty(B),
            np.zeros(B, np.int32), np.zeros(B, bool), np.ones((B, 2), np.int32),
            np.full(B, 2, np.int32), engine.table.copy(),
        )  # fmt: skip
        engine._verify(Plan.from_array(drafts.to_array(engine.shape), engine.shape))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert got == [want] and reasons == ["length"]
    assert compiled == []
