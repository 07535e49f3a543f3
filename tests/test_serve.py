"""The OpenAI-compatible server, through the official `openai` client, against offline greedy
generation (`lj.generate`): one server process for most tests, two processes for the
multi-host path. Servers run on free loopback ports; every wait is bounded."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from ladder_jax.inference import generation
from ladder_jax.inference.sampling import Sampling
from ladder_jax.interop.tokenizer import ByteTokenizer
from tests.helpers import (
    SERVE_KEY,
    SERVE_MAX_LEN,
    free_port,
    openai_client,
    running_server,
    start_server,
    stop_server,
    tiny_model,
    wait_healthy,
)

KEY = SERVE_KEY
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
MAX_LEN = SERVE_MAX_LEN
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "chat.jinja").write_text(TEMPLATE)
    with running_server(
        tmp,
        "--tp",
        "2",
        "--slots",
        "8",
        "--max-request-bytes",
        "65536",
        "--drain-seconds",
        "3",
        "--chat-template",
        str(tmp / "chat.jinja"),
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def model():
    return tiny_model(2, residual="ladder")


def _offline(model, prompts, max_tokens):
    """Greedy text of each prompt alone (`generate` batches are row-independent; a row's
    first tokens do not depend on how many follow)."""
    rows = [TOK.encode(p) if isinstance(p, str) else p for p in prompts]
    out = generation.generate(model, rows, max_new_tokens=max(max_tokens), eos_id=TOK.eos_id)
    return [TOK.decode(o[:m]) for o, m in zip(out, max_tokens)]


def test_completions_and_stream_equal_offline_greedy(server, model):
    client = openai_client(server)
    prompts = ["LOVE, n.", [256, 72, 105]]  # text, and token ids (BOS "Hi")
    want = _offline(model, prompts, [12, 12])
    for prompt, expected in zip(prompts, want):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == expected
        assert r.usage.prompt_tokens == len(
            TOK.encode(prompt) if isinstance(prompt, str) else prompt
        )
        assert r.usage.completion_tokens <= 12
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_32_concurrent_requests_each_equal_their_offline_result(server, model):
    prompts = ["x" * (1 + 2 * i) if i % 2 else [256] + list(range(65, 66 + i)) for i in range(32)]
    max_tokens = [2 + i % 9 for i in range(32)]
    want = _offline(model, prompts, max_tokens)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=240
    )

    async def one(p, m):
        r = await client.completions.create(model="tiny", prompt=p, max_tokens=m, temperature=0)
        return r.choices[0].text

    async def all_of():
        async with client:
            return await asyncio.gather(*[one(p, m) for p, m in zip(prompts, max_tokens)])

    got = asyncio.run(all_of())
    assert got == want


def test_seeded_sampling_is_reproducible_and_equals_generate(server, model):
    client = openai_client(server)
    kw = dict(
        model="tiny",
        prompt="Once",
        max_tokens=8,
        temperature=1.0,
        seed=1234,
        extra_body={"top_k": 50},
    )
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    want = generation.generate(
        model, ["Once"], max_new_tokens=8, tokenizer=TOK, sampling=Sampling(1.0, 50, None, 1234)
    )[0]
    assert a == b == want
    other = client.completions.create(**{**kw, "seed": 99}).choices[0].text
    assert other != a


def test_chat_uses_the_template(server, model):
    client = openai_client(server)
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    rendered = "<user>Hi\n<assistant>"
    assert r.choices[0].message.content == _offline(model, [rendered], [6])[0]
    assert r.usage.prompt_tokens == len(TOK.encode(rendered))
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
        )
    ]
    assert "".join(pieces) == r.choices[0].message.content


def test_stop_strings_end_the_text_before_them(server, model):
    client = openai_client(server)
    full = _offline(model, ["LOVE, n."], [12])[0]
    stop = full[3:5]
    r = client.completions.create(
        model="tiny", prompt="LOVE, n.", max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"


def test_models_metrics_and_health(server):
    client = openai_client(server)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    text = httpx.get(
        f"http://127.0.0.1:{server.port}/metrics", headers={"Authorization": f"Bearer {KEY}"}
    ).text
    for name in (
        "ladder_requests_total",
        "ladder_generation_tokens_total",
        "ladder_queue_depth",
        "ladder_slots_busy",
        "ladder_time_to_first_token_seconds_count",
    ):
        assert name in text, text
    health = httpx.get(f"http://127.0.0.1:{server.port}/health").json()
    assert health["status"] == "ok" and health["slots"] == 8


def _in_process(steps=0, slots=8):
    """A test client of an app over a stand-in engine (nothing is submitted to it)."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from ladder_jax.inference.server import App

    engine = SimpleNamespace(
        length=16,
        error=None,
        steps=steps,
        waiting=1,
        busy=2,
        slots=slots,
        config=SimpleNamespace(vocab_size=300),
    )
    return TestClient(App(engine, TOK, model_name="tiny").starlette())


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", "hot", "temperature='hot' must be a number from 0 to 2"),
        ("temperature", True, "temperature=True must be a number from 0 to 2"),
        ("top_p", 0, "top_p=0 must be in (0, 1]"),
        ("top_k", 301, "top_k=301 must be an integer from 1 to 300 (or -1: off)"),
        ("top_k", -2, "top_k=-2 must be an integer from 1 to 300 (or -1: off)"),
        ("seed", 1.0, "seed=1.0 must be an integer from 0 to 2**32 - 1"),
        ("stop", ["a", ""], "stop must be a non-empty string or a list of up to 4 of them"),
        ("stop", ["a"] * 5, "stop must be a non-empty string or a list of up to 4 of them"),
        ("stream", 1, "stream=1 must be true or false"),
        ("stream_options", {"x": 1}, "stream_options may only hold include_usage"),
        ("logprobs", True, "logprobs=True must be an integer from 0 to 20 (or null)"),
        ("echo", "yes", "echo='yes' must be true or false"),
    ],
)
def test_each_checked_field_is_one_openai_error(field, value, message):
    """In-process: a wrong field is a 400 in OpenAI's shape with its one-line message, also
    beside a second wrong field checked later (the first wrong field is named)."""
    later = {"echo": "no"} if field == "logprobs" else {"stream_options": 5}
    body = {"prompt": "x", "max_tokens": 2, field: value, **({} if field in later else later)}
    r = _in_process().post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": field, "code": None}
    }


def test_two_apps_in_one_process_count_apart():
    """Each app keeps its metrics in a registry of its own: two in one process neither collide
    nor share counts; /metrics parses as Prometheus text (prometheus_client's own parser) with
    the names, labels and values counted here by hand."""
    from prometheus_client.parser import text_string_to_metric_families

    def scraped(client):
        text = client.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    a, b = _in_process(steps=7, slots=8), _in_process(steps=0, slots=4)
    for _ in range(2):
        assert a.post("/v1/completions", content=b"{oops").status_code == 400
    assert b.post("/v1/chat/completions", content=b"[]").status_code == 400
    bad = (("endpoint", "completions"), ("status", "400"))
    ma, mb = scraped(a), scraped(b)
    assert ma[("ladder_requests_total", bad)] == 2 and ("ladder_requests_total", bad) not in mb
    assert mb[("ladder_requests_total", (("endpoint", "chat"), ("status", "400")))] == 1
    assert (ma[("ladder_decode_steps_total", ())], ma[("ladder_slots_total", ())]) == (7, 8)
    assert (mb[("ladder_decode_steps_total", ())], mb[("ladder_slots_total", ())]) == (0, 4)
    for m in (ma, mb):
        assert m[("ladder_queue_depth", ())] == 1 and m[("ladder_slots_busy", ())] == 2
        assert m[("ladder_generation_tokens_total", ())] == 0
        assert m[("ladder_time_to_first_token_seconds_count", ())] == 0
        assert m[("ladder_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 0


def test_metrics_have_no_created_series():
    """/metrics lists each series the app keeps (written out here) and no `*_created`
    timestamp series beside them."""
    client = _in_process()
    assert client.post("/v1/completions", content=b"{oops").status_code == 400
    lines = [ln for ln in client.get("/metrics").text.splitlines() if not ln.startswith("#")]
    names = {ln.split("{")[0].split()[0] for ln in lines}
    assert not [ln for ln in lines if "_created" in ln.split("{")[0]], lines
    assert names == {
        "ladder_requests_total",
        "ladder_prompt_tokens_total",
        "ladder_generation_tokens_total",
        "ladder_time_to_first_token_seconds_bucket",
        "ladder_time_to_first_token_seconds_count",
        "ladder_time_to_first_token_seconds_sum",
        "ladder_decode_steps_total",
        "ladder_prefix_cache_queried_tokens_total",
        "ladder_prefix_cache_hit_tokens_total",
        "ladder_spec_drafted_tokens_total",
        "ladder_spec_accepted_tokens_total",
        "ladder_spec_acceptance_rate",
        "ladder_preemptions_total",
        "ladder_queue_depth",
        "ladder_slots_busy",
        "ladder_slots_total",
    }, names


def _steps(server):
    text = httpx.get(
        f"http://127.0.0.1:{server.port}/metrics", headers={"Authorization": f"Bearer {KEY}"}
    ).text
    return int(
        float(
            next(
                ln.split()[-1]
                for ln in text.splitlines()
                if ln.startswith("ladder_decode_steps_total")
            )
        )
    )


def test_a_disconnect_frees_the_slot(server):
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    body = {
        "model": "tiny",
        "prompt": "a",
        "max_tokens": MAX_LEN - 8,
        "temperature": 0,
        "stream": True,
    }
    # the state the test needs: the request still generating when the client goes (on a busy
    # machine the server can finish all its tokens before this process reads the first line:
    # then the try proves nothing and the next one runs)
    for _ in range(5):
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
            with http.stream("POST", url, json=body) as r:
                lines = r.iter_lines()
                assert next(ln for ln in lines if ln.startswith("data:"))  # it is generating
                busy = httpx.get(f"http://127.0.0.1:{server.port}/health").json()["busy"]
                at = _steps(server)
                if not busy:
                    continue
        # closed after a few tokens: the slot must be free long before its 88 tokens are done
        deadline = time.monotonic() + 60
        while httpx.get(f"http://127.0.0.1:{server.port}/health").json()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _steps(server) - at < 40
        break
    else:
        pytest.fail("every request finished before its client closed it")
    r = openai_client(server).completions.create(
        model="tiny", prompt="b", max_tokens=2, temperature=0
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def _answered(server, status) -> int:
    """ladder_requests_total of /v1/completions with `status`, from /metrics."""
    text = httpx.get(
        f"http://127.0.0.1:{server.port}/metrics", headers={"Authorization": f"Bearer {KEY}"}
    ).text
    row = f'ladder_requests_total{{endpoint="completions",status="{status}"}} '
    return next((int(float(ln[len(row) :])) for ln in text.splitlines() if ln.startswith(row)), 0)


@pytest.mark.parametrize("scored", [False, True], ids=["plain", "logprobs"])
def test_a_dropped_stream_is_counted_499(server, scored):
    """A client that closes a stream mid-answer: one more 499 in ladder_requests_total (a
    plain stream and a scored one, which have their own paths), no 200."""
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    body = {
        "model": "tiny",
        "prompt": "a",
        "max_tokens": MAX_LEN - 8,
        "temperature": 0,
        "stream": True,
        **({"logprobs": 1} if scored else {}),
    }
    for _ in range(5):  # until a stream is dropped while it generates (see above)
        dropped, whole = _answered(server, 499), _answered(server, 200)
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
            with http.stream("POST", url, json=body) as r:
                assert next(ln for ln in r.iter_lines() if ln.startswith("data:"))
        deadline = time.monotonic() + 60
        while (_answered(server, 499), _answered(server, 200)) == (dropped, whole):
            assert time.monotonic() < deadline, "the dropped stream was never counted"
            time.sleep(0.05)
        if _answered(server, 200) == whole:  # not finished before the client closed it
            break
    assert _answered(server, 499) == dropped + 1 and _answered(server, 200) == whole


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x" * 200, "max_tokens": 4}, 400, "prompt"),
        ({"prompt": "x", "bogus": 1}, 400, "bogus"),
        ({"prompt": "x", "n": 2}, 400, "n"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": [1, 2, 999]}, 400, "prompt"),
        ({"prompt": "x", "seed": 2**40}, 400, "seed"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ({"prompt": "x" * 70000}, 413, None),
    ],
)
def test_bad_requests_get_their_status_and_the_server_stays_up(server, body, status, param):
    r = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/completions",
        json={"model": "tiny", **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert httpx.get(f"http://127.0.0.1:{server.port}/health").json()["status"] == "ok"


def test_malformed_json_unknown_route_and_the_api_key(server):
    base = f"http://127.0.0.1:{server.port}"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{base}/v1/nothing", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    for path in ("/v1/completions", "/v1/chat/completions"):  # no key at all
        r = httpx.post(f"{base}{path}", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/v1/models").status_code == 401
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        openai_client(server).completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert (
        openai_client(server)
        .completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
        .choices[0]
        .text
        is not None
    )


def test_sigterm_drains_and_exits_0(server):
    """Last in the file: stops the shared server."""
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    body = {
        "model": "tiny",
        "prompt": "a",
        "max_tokens": MAX_LEN - 8,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
        with http.stream("POST", url, json=body) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data:"))
            server.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln]  # it ends: finished or cut at the drain bound
        assert rest and rest[-1] == "data: [DONE]"
        final = [json.loads(ln[5:]) for ln in rest if ln.startswith("data: {")][-1]
        assert final["choices"][0]["finish_reason"] in ("length", "stop", "abort")
    assert server.wait(60) == 0, server.log.read_text()


def test_two_process_server_answers_like_one_process(tmp_path, model):
    coordinator, port = free_port(), free_port()
    common = [
        "--tp",
        "4",
        "--cpu-devices",
        "2",
        "--slots",
        "4",
        "--port",
        str(port),
        "--coordinator",
        f"127.0.0.1:{coordinator}",
        "--num-processes",
        "2",
    ]
    procs = [start_server(tmp_path, f"p{i}", *common, "--process-id", str(i)) for i in range(2)]
    try:
        wait_healthy(procs[0], port)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=240
        )
        prompts, max_tokens = ["LOVE, n.", "Hello there"], [8, 5]
        want = _offline(model, prompts, max_tokens)
        got = [
            client.completions.create(model="tiny", prompt=p, max_tokens=m, temperature=0)
            .choices[0]
            .text
            for p, m in zip(prompts, max_tokens)
        ]
        assert got == want
        stream = client.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream) == want[0]
        assert stop_server(procs[0]) == 0, procs[0].log.read_text()
        assert procs[1].wait(60) == 0, procs[1].log.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_sigterm_to_the_follower_stops_both_processes(tmp_path):
    """SIGTERM to process 1 of a healthy two-process server: process 0 is asked to drain
    (through the coordination service, said in its log) and both exit 0 within the bound."""
    coordinator, port = free_port(), free_port()
    common = [
        "--tp",
        "2",
        "--cpu-devices",
        "1",
        "--slots",
        "2",
        "--port",
        str(port),
        "--coordinator",
        f"127.0.0.1:{coordinator}",
        "--num-processes",
        "2",
        "--drain-seconds",
        "1",
    ]
    procs = [start_server(tmp_path, f"p{i}", *common, "--process-id", str(i)) for i in range(2)]
    try:
        wait_healthy(procs[0], port)
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(60) == 0, procs[1].log.read_text()
        assert procs[0].wait(60) == 0, procs[0].log.read_text()
        assert "asked by process 1 (SIGTERM)" in procs[0].log.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("steps_per_plan,prefills_per_step", [(1, 1), (3, 1), (1, 3)])
def test_engine_in_process_equals_generate_with_multi_step_plans(
    model, steps_per_plan, prefills_per_step
):
    """The engine without HTTP: 4 slots, 10 requests (prompt lengths 1..19, max_tokens 1..9,
    more requests than slots, so rows are reused mid-plan); each request's tokens equal its
    offline greedy tokens, whether the engine runs one decode step per plan or three, and
    whether it prefills the prompts admitted together one by one or in one program (3 per
    plan: groups padded to 4 rows; prompt buckets 16 and 32)."""
    import threading

    from ladder_jax.inference.batching import Engine, Request

    prompts = [[256] + list(range(40 + i, 40 + 3 * i)) for i in range(10)]
    max_tokens = [1 + (3 * i) % 9 for i in range(10)]
    want = generation.generate(model, prompts, max_new_tokens=max(max_tokens))
    engine = Engine(
        model,
        slots=4,
        max_len=48,
        steps_per_plan=steps_per_plan,
        prefills_per_step=prefills_per_step,
    )
    groups, extend_slots = [], engine.decoder.extend_slots

    def counted(cache, slots_n, *rest):
        groups.append(int((np.asarray(slots_n) < engine.slots).sum()))
        return extend_slots(cache, slots_n, *rest)

    engine.decoder.extend_slots = counted
    got, reasons, done = [[] for _ in prompts], [None] * 10, threading.Semaphore(0)

    def finish(i, why):
        reasons[i] = why
        done.release()

    reqs = [
        Request(
            prompt=p,
            max_tokens=m,
            on_token=got[i].append,
            on_finish=lambda why, i=i: finish(i, why),
        )
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    for r in reqs:  # all queued before the loop starts: its first plan admits a full group
        engine.submit(r)
    engine.start()
    try:
        for _ in reqs:
            assert done.acquire(timeout=120), (reasons, engine.error)
    finally:
        engine.drain(5)
    assert reasons == ["length"] * 10
    assert got == [w[:m] for w, m in zip(want, max_tokens)]
    assert engine.steps % steps_per_plan == 0
    # admissions per plan: prefills_per_step x steps_per_plan (1, 3, 3), all of bucket 16 first
    assert sum(groups) == 10 and max(groups) == prefills_per_step * steps_per_plan


def test_chat_template_sees_the_tokenizers_bos_and_eos(tmp_path):
    """A Llama-style template writes bos_token itself: the prompt then starts with exactly one
    BOS id (not an empty string plus an added BOS, nor two BOS); the byte tokenizer, whose
    specials have no text, gets its BOS added."""
    import jinja2.sandbox
    import tokenizers

    from ladder_jax.inference.chat import render_chat
    from ladder_jax.interop.tokenizer import HFTokenizer

    words = ["<unk>", "<s>", "</s>", "user", "hi", "assistant"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.add_special_tokens(words[:3])
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf_tok = HFTokenizer(str(tmp_path / "tokenizer.json"), bos_id=1, eos_id=2)
    template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(
        "{{ bos_token }}{% for m in messages %}{{ m.role }} {{ m.content }} {{ eos_token }} "
        "{% endfor %}assistant"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(template, messages, hf_tok) == [1, 3, 4, 2, 5]
    assert render_chat(template, messages, TOK) == [256] + list(b"user hi  assistant")


def test_warmup_says_what_it_compiles_and_sigterm_ends_an_idle_server_at_once(tmp_path):
    """Before the first compile, the KV cache's size and one line of what warm-up will compile
    (and --warmup's other choices); then k/N per program with the time left; N by hand:
    --max-len 16, one prompt per step and one step per plan is one prompt bucket (16) x one
    group (1) prefill, plus the decode round. An idle server
    exits 0 within seconds of SIGTERM (the interpreter's teardown is skipped)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ladder_jax.serve",
            "--preset",
            "tiny",
            "--max-len",
            "16",
            "--slots",
            "2",
            "--prefills-per-step",
            "1",
            "--steps-per-plan",
            "1",
            "--tp",
            "1",
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
    )
    try:
        err = []
        for line in proc.stderr:  # the warm-up's lines come before the server's first
            err.append(line.rstrip("\n"))
            if line.startswith("warm-up 2/"):
                break
        # 2 slots of 16 positions: 2 pages and the trash page, of 16 positions x (k and v, 4
        # layers, 4 kv heads of 8 float32) = 48 KiB
        assert err[0].startswith(
            "KV cache: 2 pages of 16 positions, 48.0 KiB of host memory, for 2 slots of up to "
            "16 positions (2 at full length at once): every slot fits at full length"
        ), err
        assert err[1].startswith("warm-up: compiling 2 programs before serving (--warmup"), err
        assert err[2].startswith("warm-up 1/2: prefill 1 x 16 tokens ("), err
        assert " s to go)" in err[2], err  # the rest's estimate
        assert err[3].startswith("warm-up 2/2: decode round ("), err
        assert proc.stdout.readline().startswith(f"serving 'tiny' on http://127.0.0.1:{port}")
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - start < 5, "an idle server took over 5 s to exit"
    finally:
        stop_server(proc)


def test_plan_round_trips_through_its_array_bit_for_bit():
    """A multi-host plan: `Plan.from_array(plan.to_array())` gives every field back (slots,
    drafts, the block table, chunks with their tokens in the pool), float settings bit for bit
    (-0.0, a denormal, inf, a NaN payload), at the offsets of the layout written out by hand."""
    from ladder_jax.inference.batching import Chunk, Plan, PlanShape
    from ladder_jax.inference.sampling import RowSampling

    shape = PlanShape(slots=3, admit=2, pool=16, drafts=2, pages=2)
    B = shape.slots
    odd = np.array([-0.0, 1e-45, np.inf], np.float32)
    nan = np.array([0x7FC00123], np.int32).view(np.float32)  # a NaN with a payload
    rows = RowSampling(
        np.array([[1, 2**32 - 1], [3, 4], [5, 6]], np.uint32),
        odd,
        np.array([0, 40, 1], np.int32),
        np.array([1.0, 0.9, 0.25], np.float32),
    )
    one = RowSampling(
        np.array([[7, 2**31]], np.uint32), nan, np.array([5], np.int32), np.array([0.5], np.float32)
    )
    plan = Plan(
        True,
        3,
        np.array([9, 8, 7], np.int32),
        np.array([4, 0, 11], np.int32),
        rows,
        np.array([1, 0, 3], np.int32),
        np.array([True, False, True]),
        np.array([[21, 22], [0, 0], [23, 0]], np.int32),
        np.array([2, 0, 1], np.int32),
        np.array([[5, 6], [0, 0], [7, 0]], np.int32),
        [
            Chunk(1, 32, np.array([10, 20, 30], np.int32), one, True, index=4),
            Chunk(0, 0, np.array([40, 50], np.int32), one, False, True),
        ],
    )
    arr = plan.to_array(shape)
    assert arr.dtype == np.int32 and arr.shape == (3 + 10 * B + B * 2 + B * 2 + 2 * 11 + 16,)
    assert arr.shape == (shape.size,) and arr[:3].tolist() == [1, 3, 2]
    # token, position, key (2), temperature, top_k, top_p, count, busy, drafted
    slot1 = arr[3 + 10 : 3 + 20]
    f = np.float32
    assert slot1.tolist() == [
        8,
        0,
        3,
        4,
        f(1e-45).view(np.int32),
        40,
        f(0.9).view(np.int32),
        0,
        0,
        0,
    ]
    o = 3 + 10 * B
    assert arr[o : o + 6].tolist() == [21, 22, 0, 0, 23, 0]  # the drafts
    o += 6
    assert arr[o : o + 6].tolist() == [5, 6, 0, 0, 7, 0]  # the block table
    o += 6  # chunk: slot, start, length, key (2), temperature, top_k, top_p, final, scored,
    half = f(0.5).view(np.int32)  # index
    assert arr[o : o + 11].tolist() == [1, 32, 3, 7, -(2**31), 0x7FC00123, 5, half, 1, 0, 4]
    assert arr[o + 11 : o + 22].tolist() == [0, 0, 2, 7, -(2**31), 0x7FC00123, 5, half, 0, 1, 0]
    o += 22
    assert arr[o:].tolist() == [10, 20, 30, 40, 50] + [0] * 11  # the pool
    back = Plan.from_array(arr, shape)
    assert (back.run, back.decode, len(back.chunks)) == (True, 3, 2)
    for got, want in [
        (back.tokens_b, plan.tokens_b),
        (back.positions_b, plan.positions_b),
        (back.count_b, plan.count_b),
        (back.busy_b, plan.busy_b),
        (back.drafts_bk, plan.drafts_bk),
        (back.drafted_b, plan.drafted_b),
        (back.table_bm, plan.table_bm),
    ]:
        np.testing.assert_array_equal(got, want)
    for got, want in [(back.rows, rows), (back.chunks[0].rows, one), (back.chunks[1].rows, one)]:
        for field in ("keys", "temperature", "top_k", "top_p"):
            g, w = getattr(got, field), getattr(want, field)
            assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), field
    for got, want in zip(back.chunks, plan.chunks):
        assert (got.slot, got.start, got.tokens.tolist(), got.final, got.scored, got.index) == (
            want.slot,
            want.start,
            want.tokens.tolist(),
            want.final,
            want.scored,
            want.index,
        )
    stop = Plan(
        False,
        0,
        *(np.zeros(B, np.int32),) * 2,
        RowSampling.empty(B),
        np.zeros(B, np.int32),
        np.zeros(B, bool),
        np.zeros((B, 2), np.int32),
        np.zeros(B, np.int32),
        np.zeros((B, 2), np.int32),
    )
    assert not Plan.from_array(stop.to_array(shape), shape).run
    stop.chunks = [Chunk(0, 0, np.arange(17, dtype=np.int32), one, True)]
    with pytest.raises(ValueError, match="at most 16 tokens"):
        stop.to_array(shape)


def test_a_background_warm_up_serves_at_once_and_finishes(tmp_path, model):
    """`--warmup background`: the server answers while its programs compile on a thread (the
    greedy text of an offline run), the warm-up still finishes and says so, and SIGTERM then
    ends the server with 0."""
    port = free_port()
    log = tmp_path / "background.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "ladder_jax.serve", "--preset", "tiny", "--residual",
                "ladder", "--tp", "2", "--max-len", str(MAX_LEN), "--slots", "2", "--port",
                str(port), "--warmup", "background",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
        )  # fmt: skip
    proc.log = log
    try:
        wait_healthy(proc, port)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "LOVE, n.", "max_tokens": 8, "temperature": 0},
            timeout=240,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _offline(model, ["LOVE, n."], [8])[0]
        deadline = time.monotonic() + 240
        while "warm-up: done" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
        text = log.read_text()
        assert "warm-up: compiling 6 programs while serving" in text, text
        assert "warm-up: done, every warm-up program is compiled" in text, text
    finally:
        assert stop_server(proc) == 0, log.read_text()
