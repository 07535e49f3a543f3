"""Logprobs in the server (`/v1/completions` with logprobs, echo, max_tokens=0, batched
prompts), through the official `openai` client and raw HTTP, against an independent full
forward of the same weights (`model(tokens)` then `jax.nn.log_softmax`), and the engine's
scored programs in-process."""

import json
import threading

import httpx
import jax
import numpy as np
import pytest

from ladder_jax.inference import generation
from ladder_jax.inference.sampling import Sampling
from ladder_jax.interop.tokenizer import ByteTokenizer
from tests.helpers import SERVE_KEY as KEY
from tests.helpers import logits, openai_client, running_server, tiny_model

TOK = ByteTokenizer()
ATOL = 2e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("logprobs"), "--tp", "2", "--slots", "4") as p:
        yield p


@pytest.fixture(scope="module")
def model():
    return tiny_model(2, residual="ladder")


def _post(server, body):
    return httpx.post(
        f"http://127.0.0.1:{server.port}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=180,
    )


def _log_softmax(model, ids):
    """(T, V) float64 log-probabilities of a full forward over `ids`: row t predicts t + 1."""
    out = logits(model, np.array([ids], np.int32))[0]
    return np.asarray(jax.nn.log_softmax(out.astype(np.float32)), np.float64)


def _check_top(top, lp_v, n):
    """A top_logprobs dict against one row of the forward's log-softmax: each text's value is
    the best log p among the ids of that text, the N most likely ids' texts are all there, and
    nothing else but at most the token itself."""
    texts = [TOK.decode([i]) for i in range(lp_v.shape[0])]
    best = {}
    for i in np.argsort(-lp_v, kind="stable"):
        best.setdefault(texts[i], lp_v[i])
    want = {texts[i] for i in np.argsort(-lp_v, kind="stable")[:n]}
    assert want <= set(top) and len(top) <= n + 1, (top, want)
    for key, value in top.items():
        assert abs(value - best[key]) < ATOL, (key, value, best[key])


def test_echo_scores_the_prompt_like_a_forward(server, model):
    prompt = "LOVE, n. A temporary insanity"
    ids = TOK.encode(prompt)
    r = openai_client(server, timeout=180).completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=5
    )
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.tokens == [""] + list(prompt)  # BOS has no text
    assert lp.text_offset == [0] + list(range(len(prompt)))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    lp_tv = _log_softmax(model, ids)
    want = [lp_tv[t - 1, ids[t]] for t in range(1, len(ids))]
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=ATOL)
    for t in range(1, len(ids)):
        _check_top(lp.top_logprobs[t], lp_tv[t - 1], 5)


def test_greedy_generation_logprobs_equal_a_forward_over_prompt_and_output(server, model):
    prompt, n = "Once upon", 10
    ids = TOK.encode(prompt)
    new = generation.generate(model, [ids], max_new_tokens=n, eos_id=TOK.eos_id)[0]
    client = openai_client(server, timeout=180)
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, logprobs=3
    )
    c = r.choices[0]
    assert c.text == TOK.decode(new)
    lp_tv = _log_softmax(model, ids + new)
    P = len(ids)
    want = [lp_tv[P - 1 + i, t] for i, t in enumerate(new)]
    lp = c.logprobs
    assert len(lp.token_logprobs) == len(new)
    np.testing.assert_allclose(lp.token_logprobs, want, atol=ATOL)
    for i, top in enumerate(lp.top_logprobs):
        _check_top(top, lp_tv[P - 1 + i], 3)
        assert abs(lp.token_logprobs[i] - max(top.values())) < ATOL  # greedy: the best
    # echo with generation: the prompt's scores, then the same generated ones
    e = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, logprobs=3, echo=True
    ).choices[0]
    assert e.text == prompt + c.text
    assert e.logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(
        e.logprobs.token_logprobs[1:],
        [lp_tv[t - 1, (ids + new)[t]] for t in range(1, P + len(new))],
        atol=ATOL,
    )
    assert e.logprobs.text_offset[P:] == [P - 1 + o for o in lp.text_offset]


def test_sampled_tokens_are_scored_from_the_raw_logits(server, model):
    """temperature 0.5 and top_k 5 shape the draw, not the reported log p."""
    prompt, n, seed = "The", 8, 77
    ids = TOK.encode(prompt)
    new = generation.generate(
        model, [ids], max_new_tokens=n, eos_id=TOK.eos_id, sampling=Sampling(0.5, 5, None, seed)
    )[0]
    r = openai_client(server, timeout=180).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=n,
        temperature=0.5,
        seed=seed,
        logprobs=0,
        extra_body={"top_k": 5},
    )
    c = r.choices[0]
    assert c.text == TOK.decode(new)
    lp_tv = _log_softmax(model, ids + new)
    np.testing.assert_allclose(
        c.logprobs.token_logprobs,
        [lp_tv[len(ids) - 1 + i, t] for i, t in enumerate(new)],
        atol=ATOL,
    )
    # logprobs=0: no alternatives, only the token itself
    assert all(len(top) == 1 for top in c.logprobs.top_logprobs)


def test_batched_prompts_as_lm_eval_sends_them(server, model):
    """local-completions' loglikelihood body: token-id prompts, max_tokens 1, logprobs 1,
    echo; it sums token_logprobs[ctxlen:-1]. Then text prompts through the openai client."""
    contexts = [TOK.encode("Question: 2+2=? Answer:"), TOK.encode("Sky color:")]
    conts = [list(b" 4"), list(b" blue")]
    body = {
        "model": "tiny",
        "prompt": [c + d for c, d in zip(contexts, conts)],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = _post(server, body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for c, ctx, cont in zip(choices, contexts, conts):
        seq = ctx + cont
        lp_tv = _log_softmax(model, seq)
        got = sum(c["logprobs"]["token_logprobs"][len(ctx) : -1])
        want = sum(lp_tv[t - 1, seq[t]] for t in range(len(ctx), len(seq)))
        assert abs(got - want) < 1e-3, (got, want)
        assert len(c["logprobs"]["tokens"]) == len(seq) + 1  # and the one generated token
        assert all(len(top) <= 2 for top in c["logprobs"]["top_logprobs"][1:])
    texts = ["ab", "LOVE, n."]
    r = openai_client(server, timeout=180).completions.create(
        model="tiny", prompt=texts, max_tokens=0, echo=True, logprobs=2
    )
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == texts
    for c in r.choices:
        ids = TOK.encode(texts[c.index])
        lp_tv = _log_softmax(model, ids)
        np.testing.assert_allclose(
            c.logprobs.token_logprobs[1:],
            [lp_tv[t - 1, ids[t]] for t in range(1, len(ids))],
            atol=ATOL,
        )
    assert r.usage.prompt_tokens == sum(len(TOK.encode(t)) for t in texts)


def test_streamed_logprobs_add_up_to_the_whole_answer(server):
    client = openai_client(server, timeout=180)
    kw = dict(model="tiny", prompt="LOVE, n.", max_tokens=12, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    for echo in (False, True):
        chunks = [
            c.choices[0]
            for c in client.completions.create(**kw, echo=echo, stream=True)
            if c.choices
        ]
        assert "".join(c.text for c in chunks) == ("LOVE, n." if echo else "") + whole.text
        got = {
            k: sum((getattr(c.logprobs, k) for c in chunks if c.logprobs), [])
            for k in ("tokens", "token_logprobs", "text_offset")
        }
        skip = len(TOK.encode("LOVE, n.")) if echo else 0
        assert got["tokens"][skip:] == whole.logprobs.tokens
        assert got["token_logprobs"][skip:] == whole.logprobs.token_logprobs
        assert [
            o - (8 if echo else 0) for o in got["text_offset"][skip:]
        ] == whole.logprobs.text_offset


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "logprobs": "5"}, "logprobs"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
        ({"prompt": ["ab", [1, 2, 999]], "logprobs": 1}, "prompt"),
        ({"prompt": ["ab", ""], "echo": True, "max_tokens": 0}, "prompt"),
        ({"prompt": ["ab", "cd"], "stream": True}, "stream"),
    ],
)
def test_bad_scoring_requests_are_one_openai_error(server, body, param):
    r = _post(server, {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"] and "\n" not in err["message"]


def test_chat_logprobs_stay_refused(server):
    r = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] in ("logprobs", "messages")


def test_engine_scores_only_what_is_asked_and_keeps_greedy_tokens(model):
    """In-process: scored and plain requests prefilled together and decoded together (2 steps
    per plan); each request's tokens equal offline greedy, scored ones carry the forward's
    log p, plain ones none."""
    from ladder_jax.inference.batching import Engine, Request

    prompts = [[256] + list(range(60 + i, 66 + 2 * i)) for i in range(4)]
    want = generation.generate(model, prompts, max_new_tokens=5)
    engine = Engine(model, slots=4, max_len=48, steps_per_plan=2, prefills_per_step=2)
    done = threading.Semaphore(0)
    got = [[] for _ in prompts]
    reqs = [
        Request(
            prompt=p,
            max_tokens=5,
            on_token=got[i].append,
            on_finish=lambda why: done.release(),
            logprobs=2 if i % 2 else None,
            echo=i == 3,
        )
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.submit(r)
    engine.start()
    try:
        for _ in reqs:
            assert done.acquire(timeout=300), engine.error
    finally:
        engine.drain(5)
    assert got == want
    for i, r in enumerate(reqs):
        if i % 2 == 0:
            assert r.scores == [] and r.prompt_scores is None
            continue
        seq = prompts[i] + got[i]
        lp_tv = _log_softmax(model, seq)
        P = len(prompts[i])
        np.testing.assert_allclose(
            [s[0] for s in r.scores[:5]],
            [lp_tv[P - 1 + j, t] for j, t in enumerate(got[i])],
            atol=ATOL,
        )
        assert all(
            len(s[1]) == 2 and s[1][0] == np.argmax(lp_tv[P - 1 + j])
            for j, s in enumerate(r.scores[:5])
        )
    assert reqs[1].prompt_scores is None
    np.testing.assert_allclose(
        [s[0] for s in reqs[3].prompt_scores],
        [_log_softmax(model, prompts[3])[t - 1, prompts[3][t]] for t in range(1, len(prompts[3]))],
        atol=ATOL,
    )


def test_max_tokens_zero_with_echo_generates_nothing(server):
    r = _post(server, {"model": "tiny", "prompt": [256, 72, 105], "max_tokens": 0, "echo": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] == "Hi" and c["logprobs"] is None and c["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0
    json.dumps(r.json())
