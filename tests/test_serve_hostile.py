"""The server under hostile or careless clients: a long prompt scored with echo + logprobs
(text offsets in linear time, off the event loop), lone surrogates, strings for booleans, a
batch the queue can never hold, stop lists, dropped requests, clients holding half-sent
requests, bad start-up flags. Each case is refused in one line or served, and the server keeps
serving after it."""

import asyncio
import contextlib
import json
import resource
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import tokenizers
from starlette.testclient import TestClient

from ladder_jax.cli import decode, serve
from ladder_jax.config import ConfigError
from ladder_jax.inference.answers import TextStream
from ladder_jax.inference.detokenize import Detokenizer
from ladder_jax.inference.server import App
from ladder_jax.interop.tokenizer import ByteTokenizer
from tests.helpers import SERVE_KEY as KEY
from tests.helpers import cli_error, run_module, running_server

TOK = ByteTokenizer()
FDS = 256  # the server's file descriptors in this module
TEXT = "Ladder résidus 🪜 ünd Ωmega, " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server with a queue of 4 and 256 file descriptors (inherited: the limit is lowered
    in this process while it starts)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    stack = contextlib.ExitStack()
    resource.setrlimit(resource.RLIMIT_NOFILE, (FDS, hard))
    try:
        tmp = tmp_path_factory.mktemp("hostile")
        proc = stack.enter_context(running_server(tmp, "--max-queue", "4"))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with stack:
        yield proc


def _post(server, body, path="/v1/completions"):
    return httpx.post(
        f"http://127.0.0.1:{server.port}{path}",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )


def _still_serves(server):
    r = _post(server, {"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def _answered(server, status) -> int:
    text = httpx.get(
        f"http://127.0.0.1:{server.port}/metrics", headers={"Authorization": f"Bearer {KEY}"}
    ).text
    row = f'ladder_requests_total{{endpoint="completions",status="{status}"}} '
    return next((int(float(ln[len(row) :])) for ln in text.splitlines() if ln.startswith(row)), 0)


# -- text offsets: linear, equal to the full decode ---------------------------------------------


def _bpe():
    """A small byte-level BPE tokenizer (the `tokenizers` package), trained here."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT] * 20, trainer)
    return SimpleNamespace(
        decode=lambda ids: tok.decode(list(ids)), encode=lambda t: tok.encode(t).ids
    )


class Counting:
    """A tokenizer whose decode counts the tokens it is handed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_text_offsets_equal_the_full_decode_in_linear_time(which):
    """Detokenizer.starts[i] == len(decode(ids[:i]) without a cut character at its end), the
    definition of OpenAI's text_offset, computed here the quadratic way; the text equals the
    full decode; the tokens handed to decode grow linearly with the prompt."""
    tok = TOK if which == "bytes" else _bpe()
    ids = TOK.encode(TEXT, bos=False) if which == "bytes" else tok.encode(TEXT)
    text = Detokenizer(tok)
    text.extend(ids)
    want = [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert text.starts == want and text.text() == tok.decode(ids)
    decoded = []
    for n in (1000, 4000):
        counting = Counting(tok)
        Detokenizer(counting).extend((ids * (n // len(ids) + 1))[:n])
        decoded.append(counting.decoded)
    assert decoded[1] <= 4.2 * decoded[0] and decoded[1] <= 20 * 4000, decoded


class FakeEngine:
    """Stands in for the engine: scores every prompt token at once and finishes (echo with
    max_tokens=0), with the shape the server reads."""

    def __init__(self, tokenizer, length=1 << 16):
        self.tokenizer, self.length = tokenizer, length
        self.config = SimpleNamespace(vocab_size=300)
        self.error, self.steps, self.waiting, self.busy, self.slots = None, 0, 0, 0, 1

    def submit_all(self, reqs):
        for req in reqs:
            req.prompt_scores = [(-1.0, [65], [-0.5])] * (len(req.prompt) - 1)
            self.tokenizer.submitted.set()
            req.on_finish("length")

    def cancel(self, req):
        pass


class Gated(Counting):
    """Counts decoded tokens; once a request is submitted, its first decode waits for
    `release` (up to 30 s, then says it timed out): the answer is being built."""

    def __init__(self):
        super().__init__(TOK)
        self.eos_id, self.bos_id = TOK.eos_id, TOK.bos_id
        self.encode, self.special_text = TOK.encode, TOK.special_text
        self.submitted, self.entered, self.release = (threading.Event() for _ in range(3))
        self.timed_out = False

    def decode(self, ids):
        if self.submitted.is_set() and not self.entered.is_set():
            self.entered.set()
            self.timed_out = not self.release.wait(30)
        return super().decode(ids)


def _prompt(n):
    return ("x" * 7 + "é") * (n // 9)


def _score(client, n):
    body = {"prompt": _prompt(n), "max_tokens": 0, "echo": True, "logprobs": 1}
    return client.post("/v1/completions", json=body)


def test_a_long_scored_prompt_leaves_health_answering_and_decodes_linearly():
    """/health answers while a scoring request builds its answer (its decode held open until
    then); the tokens decoded for the answer grow linearly with the prompt (8,190 tokens
    too: quadratic would be ~33 million)."""
    tok = Gated()
    app = App(FakeEngine(tok), tok, model_name="tiny", max_request_bytes=1 << 22).starlette()

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            scoring = asyncio.create_task(_score(c, 8190))
            assert await asyncio.to_thread(tok.entered.wait, 60)  # building its answer
            health = await c.get("/health")
            tok.release.set()
            return health, await scoring

    health, scored = asyncio.run(main())
    assert not tok.timed_out, "the answer was built on the event loop"
    assert health.status_code == 200 and scored.status_code == 200
    ids = TOK.encode(_prompt(8190))
    offsets = scored.json()["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [len(TOK.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    decoded = []
    for n in (2000, 8000):
        tok = Gated()
        tok.entered.set()  # no gate
        app = App(FakeEngine(tok), tok, model_name="t", max_request_bytes=1 << 22).starlette()
        assert _score(TestClient(app), n).status_code == 200
        decoded.append(tok.decoded)
    assert decoded[1] <= 4.5 * decoded[0] and decoded[1] < 30 * 8000, decoded


# -- request bodies ------------------------------------------------------------------------------


def _in_process():
    engine = SimpleNamespace(
        length=16,
        error=None,
        steps=0,
        waiting=0,
        busy=0,
        slots=1,
        config=SimpleNamespace(vocab_size=300),
    )
    return TestClient(
        App(engine, TOK, model_name="tiny", chat_template="{{ messages }}").starlette()
    )


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": "a", "stop": ["\\udfff"], "max_tokens": 1}', "stop"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages",
        ),
        ("/v1/completions", '{"prompt": "a", "\\ud800": 1}', None),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(path, body, param):
    r = _in_process().post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "lone surrogate" in error["message"] and error["param"] == param
    assert "\n" not in error["message"]


@pytest.mark.parametrize("value", ["yes", "false", 1, 0])
def test_include_usage_takes_only_booleans(value):
    body = {
        "prompt": "a",
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": value},
    }
    r = _in_process().post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": f"stream_options.include_usage={value!r} must be true or false",
        "type": "invalid_request_error",
        "param": "stream_options",
        "code": None,
    }


def test_the_earliest_stop_string_cuts_the_text():
    """stop=["b", "ab"]: both complete with the same token, "ab" starts first; a multi-byte
    character's bytes arrive one by one (held back until whole)."""
    stream = TextStream(TOK, ["b", "ab"])
    pieces = [stream.add(t) for t in TOK.encode("xé ab", bos=False)]
    assert "".join(pieces) == "xé " and stream.stopped


# -- the real server ---------------------------------------------------------------------------


def test_a_batch_larger_than_the_queue_is_refused_for_good_and_no_one_else(server):
    """5 prompts on a queue of 4: a 400 that says it can never fit; a batch of 4 right after
    is served (no 503 left over from the refused one)."""
    r = _post(server, {"prompt": ["a"] * 5, "max_tokens": 2})
    assert r.status_code == 400 and "can never fit" in r.json()["error"]["message"], r.text
    r = _post(server, {"prompt": ["a", "b", "c", "d"], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text


def _load(server) -> int:
    health = httpx.get(f"http://127.0.0.1:{server.port}/health").json()
    return health["busy"] + health["waiting"]


def test_a_dropped_request_leaves_no_traceback_in_the_log(server):
    """Non-streamed requests whose clients go away while they run: 499s, no asyncio
    traceback in the log (tries until three were dropped while running)."""
    before = _answered(server, 499)
    body = json.dumps({"prompt": "a", "max_tokens": 90}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    for _ in range(10):
        answered = _answered(server, 200)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(head + body)
            deadline = time.monotonic() + 60
            while not _load(server) and _answered(server, 200) == answered:  # the server has it
                assert time.monotonic() < deadline
        deadline = time.monotonic() + 60
        while _load(server):  # its slot freed
            assert time.monotonic() < deadline
            time.sleep(0.05)
        if _answered(server, 499) >= before + 3:
            break
    assert _answered(server, 499) >= before + 3
    _still_serves(server)
    log = server.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_half_sent_requests_never_lock_health_out(server):
    """More connections holding half-sent headers than the server has file descriptors: the
    oldest are closed, /health answers, and a request is served."""
    held = []
    try:
        for _ in range(FDS + 150):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            held.append(s)
        r = httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=30)
        assert r.status_code == 200
        _still_serves(server)
    finally:
        for s in held:
            s.close()


# -- start-up flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["0", "70000", "-1"])
def test_a_port_outside_1_to_65535_is_one_line(capsys, port):
    line = cli_error(capsys, serve.main, ["--port", port])
    assert f"--port {port}: a TCP port is from 1 to 65535" in line


def test_max_len_above_the_models_context_is_refused():
    r = run_module("serve", "--preset", "tiny", "--max-len", "100000", "--no-warmup")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --max-len 100000: more than the model's context of 256 positions "
        "(max_seq_len); give at most that"
    ], r.stderr


@pytest.mark.parametrize(
    "template, says",
    [
        ("{% if %}", "the chat template is not valid Jinja (line 1"),
        ("{{ raise_exception('no users here') }}", "refused these messages: no users here"),
    ],
)
def test_decode_chat_with_a_broken_template_is_one_line(template, says):
    tok = SimpleNamespace(
        chat_template=template, bos_id=None, eos_id=None, special_text=lambda i: ""
    )
    with pytest.raises(ConfigError, match="--chat: ") as e:
        decode._chat_rows(tok, ["hi"])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_decode_a_prompt_that_is_not_utf8_is_one_line():
    r = run_module("decode", "--preset", "tiny", "--prompt", "ab\udcffc")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: prompt 0: character 2 is not UTF-8 text ('\\udcff'): give UTF-8 text"
    ], r.stderr


def test_prefills_split_at_the_token_budget_keep_greedy_tokens(monkeypatch):
    """With a budget of 32 prompt tokens per prefill program, four prompts of the 32 bucket
    are prefilled one by one (and two of the 16 bucket together): each request's tokens still
    equal offline greedy generation of its prompt alone."""
    from ladder_jax.inference import batching, generation
    from ladder_jax.inference.batching import Engine, Request
    from tests.helpers import tiny_model

    monkeypatch.setattr(batching, "PREFILL_TOKENS", 32)
    assert batching.prefill_rows(32) == 1 and batching.prefill_rows(16) == 2
    model = tiny_model(1)
    prompts = [[256, *range(65, 65 + 20 + i)] for i in range(4)] + [[256, 70], [256, 71, 72]]
    want = generation.generate(model, prompts, max_new_tokens=4)
    engine = Engine(model, slots=6, max_len=48, prefills_per_step=6, steps_per_plan=1)
    done = threading.Semaphore(0)
    got = [[] for _ in prompts]
    reqs = [
        Request(prompt=p, max_tokens=4, on_token=got[i].append, on_finish=lambda r: done.release())
        for i, p in enumerate(prompts)
    ]
    engine.submit_all(reqs)
    engine.start()
    try:
        for _ in reqs:
            assert done.acquire(timeout=300), engine.error
    finally:
        engine.drain(5)
    assert got == want
