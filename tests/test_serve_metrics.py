"""The prefix-cache and speculative-decoding counts the server reports, over a stand-in engine
that answers at once and sets them: `usage.prompt_tokens_details.cached_tokens` of plain,
chat, batched and streamed answers, and the /metrics series read from the engine."""

import json
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from ladder_jax.inference.server import App
from ladder_jax.interop.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
ANSWER = b"ok!"
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


class FakeEngine:
    """Answers each request with ANSWER at once. With `block`, a request reuses the whole
    blocks of its prompt it shares with an earlier prompt (at most all but its last token), as
    a prefix cache would; the counts the server reads are kept as the engine keeps them."""

    def __init__(self, block=None):
        self.block, self.seen = block, []
        self.config = SimpleNamespace(vocab_size=300)
        self.error, self.steps, self.waiting, self.busy, self.slots, self.length = (
            None, 0, 0, 0, 2, 4096,
        )  # fmt: skip
        if block is not None:
            self.prefix_queried_tokens = self.prefix_hit_tokens = 0
            self.drafted_tokens = self.accepted_tokens = 0

    def submit_all(self, reqs):
        for req in reqs:
            if self.block is not None:
                req.cached_tokens = max((self.shared(req.prompt, p) for p in self.seen), default=0)
                self.prefix_queried_tokens += len(req.prompt)
                self.prefix_hit_tokens += req.cached_tokens
                self.drafted_tokens += 4
                self.accepted_tokens += 3
            self.seen.append(req.prompt)
            for t in list(ANSWER)[: req.max_tokens]:
                req.on_token(t)
            req.on_finish("length")

    def shared(self, prompt, earlier):
        n = 0
        while n < min(len(prompt) - 1, len(earlier)) and prompt[n] == earlier[n]:
            n += 1
        return n // self.block * self.block

    def cancel(self, req):
        pass


def client(engine):
    return TestClient(App(engine, TOK, model_name="tiny", chat_template=TEMPLATE).starlette())


def scraped(c) -> dict:
    return {
        s.name: s.value
        for f in text_string_to_metric_families(c.get("/metrics").text)
        for s in f.samples
        if not s.labels
    }


SYSTEM = "You are a terse assistant. " * 3  # 81 bytes


def test_usage_says_the_cached_prompt_tokens():
    engine = FakeEngine(block=16)
    c = client(engine)
    bodies = [
        {"prompt": SYSTEM + "Why?", "max_tokens": 3},
        {"prompt": SYSTEM + "How?", "max_tokens": 3},
        {"prompt": [256, 1, 2], "max_tokens": 3},
    ]
    want = [0, 80, 0]  # BOS + 81 bytes in common: the 5 whole blocks of 16
    for body, cached in zip(bodies, want):
        r = c.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["prompt_tokens_details"] == {"cached_tokens": cached}
        assert u["prompt_tokens"] == len(engine.seen[-1]) and u["completion_tokens"] == 3
    chat = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}]}
    for cached in (0, 96):
        r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, **chat})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "ok"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    m = scraped(c)
    queried = sum(map(len, engine.seen))
    assert m["ladder_prefix_cache_queried_tokens_total"] == queried
    assert m["ladder_prefix_cache_hit_tokens_total"] == 80 + 96
    assert m["ladder_spec_drafted_tokens_total"] == 4 * 5
    assert m["ladder_spec_accepted_tokens_total"] == 3 * 5
    assert m["ladder_spec_acceptance_rate"] == pytest.approx(0.75)


def test_a_batch_and_a_stream_sum_and_send_the_cached_tokens():
    c = client(FakeEngine(block=4))
    r = c.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": ["abcdefghij", "abcdefgxyz"], "max_tokens": 1},
    )  # a batch of prompts: one engine request each, in order; the second shares BOS + abcdefg
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    body = {
        "model": "tiny",
        "prompt": "abcdefgh",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with c.stream("POST", "/v1/completions", json=body) as r:
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}


def test_an_engine_without_the_counts_reports_zero():
    """Before the engine keeps these counts (or with the cache off): zeros, no failure."""
    c = client(FakeEngine())
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 2})
    assert r.json()["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    m = scraped(c)
    for name in (
        "ladder_prefix_cache_queried_tokens_total",
        "ladder_prefix_cache_hit_tokens_total",
        "ladder_spec_drafted_tokens_total",
        "ladder_spec_accepted_tokens_total",
        "ladder_spec_acceptance_rate",
    ):
        assert m[name] == 0, name
