"""The paper-quality experiment (ladder_jax.experiments.paper_quality, benchmarks/paper_quality.py)
end to end on tiny shapes, its held-out evaluation against a plain forward, its by-document
split, its command line's bad input, and the notebook that shows it."""

import io
import json
import math
import os
import pathlib

import nbformat
import numpy as np
import pytest
from flax import nnx
from nbclient import NotebookClient
from omegaconf import OmegaConf

import ladder_jax as lj
from ladder_jax.experiments import corpora
from ladder_jax.experiments import paper_quality as pq
from ladder_jax.interop.tokenizer import make_tokenizer
from ladder_jax.train import data
from tests import desync_reference
from tests.helpers import benchmark, cli_error, logits, mesh, shrink

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOK = ROOT / "notebooks" / "paper.ipynb"

# Tiny: 4 layers (upper 2 and 3 converted), 24 steps, one seed. Every scheme and every
# conversion is a separate compile, so shapes stay minimal.
TINY = pq.with_changes(
    pq.SETTINGS["quick"],
    n_layers=4,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    seq_len=32,
    batch_size=8,
    steps=24,
    seeds=(0,),
    warmup_steps=2,
    peak_lr=1e-2,
    finetune_fraction=0.25,
    adapt_layers=(0.5, 0.75),
    eval_records=48,
    eval_batch=16,
)

# The notebook's run: TINY's shapes and budgets, with the quick setting's two seeds.
NOTEBOOK_CHANGES = dict(
    n_layers=4,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    seq_len=32,
    batch_size=8,
    steps=12,
    seeds=(0, 1),
    warmup_steps=2,
    finetune_fraction=0.25,
    adapt_layers=(0.5, 0.75),
    eval_records=48,
    eval_batch=16,
)

FIELDS = {
    "corpus": {
        "setting",
        "corpus",
        "setup",
        "train_docs",
        "held_out_docs",
        "train_bytes",
        "held_out_bytes",
        "held_out_titles",
        "held_out_tokens",
    },
    "scratch": {
        "setting",
        "corpus",
        "residual",
        "seed",
        "steps",
        "tokens",
        "params",
        "held_out_loss",
        "held_out_ppl",
        "train_loss_last",
        "curve",
        "run",
        "wall_s",
    },
    "summary": {
        "residual",
        "seeds",
        "loss_mean",
        "loss_std",
        "loss_min",
        "loss_max",
        "ppl_mean",
        "vs_standard_loss",
        "vs_standard_loss_std",
        "vs_standard_ppl_ratio",
        "paper_wikitext_ppl",
    },
    "adapt": {
        "setting",
        "corpus",
        "seed",
        "ladder_layers",
        "n_layers",
        "base_loss",
        "zero_shot_loss",
        "finetuned_loss",
        "control_loss",
        "finetune_steps",
        "finetune_tokens",
        "pretrain_tokens",
        "finetune_share",
        "curve",
        "wall_s",
    },
    "claim": {"claim", "paper", "measured", "reproduces"},
    "done": {"setting", "wall_s"},
}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("paper_quality"))
    emitted = []
    results = pq.run(TINY, out, emit=emitted.append, log=lambda m: None, trainer_out=io.StringIO())
    return out, results, emitted


def _numbers(x):
    if isinstance(x, dict):
        return [v for y in x.values() for v in _numbers(y)]
    if isinstance(x, (list, tuple)):
        return [v for y in x for v in _numbers(y)]
    return [x] if isinstance(x, float) else []


def test_every_result_has_its_fields_and_is_finite(experiment):
    out, results, emitted = experiment
    assert emitted == results
    kinds = [r["kind"] for r in results]
    assert kinds.count("scratch") == 3 and kinds.count("summary") == 3
    assert kinds.count("adapt") == 2 and kinds.count("claim") == 5
    assert kinds[0] == "corpus" and kinds[-1] == "done"
    for r in results:
        assert FIELDS[r["kind"]] <= set(r), (r["kind"], FIELDS[r["kind"]] - set(r))
        assert all(math.isfinite(v) for v in _numbers(r)), r
    with open(os.path.join(out, "results.jsonl")) as f:
        assert [json.loads(line) for line in f] == json.loads(json.dumps(results))
    for r in results:
        if r["kind"] == "scratch":
            assert len(r["curve"]) == TINY.steps
            assert r["curve"][-1] < r["curve"][0] - 0.5  # it trained
            assert r["tokens"] == TINY.steps * TINY.batch_size * TINY.seq_len


def test_the_schemes_really_differ(experiment):
    _, results, _ = experiment
    scratch = {r["residual"]: r for r in results if r["kind"] == "scratch"}
    for a, b in (("standard", "parallel"), ("standard", "ladder"), ("parallel", "ladder")):
        assert abs(scratch[a]["held_out_loss"] - scratch[b]["held_out_loss"]) > 1e-4, (a, b)
    adapt = {r["ladder_layers"]: r for r in results if r["kind"] == "adapt"}
    assert sorted(adapt) == [2, 3]
    for k, r in adapt.items():
        assert r["base_loss"] == scratch["standard"]["held_out_loss"]
        # the same weights rewired: a different function (after 24 steps the upper modules'
        # outputs are still small, so the gap is small, but far above float32 rounding)
        assert abs(r["zero_shot_loss"] - r["base_loss"]) > 2e-5, k
        assert r["finetuned_loss"] != r["zero_shot_loss"]
        assert r["finetune_steps"] == 6 and r["finetune_tokens"] == 6 * 8 * 32
    assert adapt[2]["zero_shot_loss"] != adapt[3]["zero_shot_loss"]
    assert adapt[2]["control_loss"] == adapt[3]["control_loss"]


def test_runs_are_the_configured_schemes(experiment):
    out, _, _ = experiment
    for name, residual, layers in (
        ("ladder-seed0", "ladder", None),
        ("parallel-seed0", "parallel", None),
        ("adapt-ladder3", "ladder", 3),
        ("adapt-standard", "standard", None),
    ):
        cfg = OmegaConf.load(os.path.join(out, "runs", name, "config.yaml"))
        assert (cfg.model.residual, cfg.model.ladder_layers) == (residual, layers)
        assert cfg.data.path.endswith(os.path.join("devils", "train"))
    cfg = OmegaConf.load(os.path.join(out, "runs", "adapt-ladder2", "config.yaml"))
    assert cfg.init_from.endswith(os.path.join("runs", "standard-seed0"))


def test_held_out_loss_matches_a_plain_forward(experiment):
    """The cached held-out loss of a run against an independent computation: every evaluated
    record through one unbatched forward, log-softmax in numpy."""
    out, results, _ = experiment
    row = next(r for r in results if r["kind"] == "scratch" and r["residual"] == "ladder")
    model, _ = lj.load(row["run"], mesh=mesh(1))
    tokens = data.load_tokens(
        os.path.join(out, "data", "devils", "held_out"), make_tokenizer("byte")
    )
    T = TINY.seq_len
    n = (len(tokens) - 1) // T
    index = np.linspace(0, n - 1, TINY.eval_records).round().astype(int)
    x = np.stack([tokens[i * T : i * T + T + 1] for i in index]).astype(np.int32)
    z = np.asarray(logits(model, x[:, :-1]), np.float64)
    z -= z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, x[:, 1:, None], -1).mean()
    assert row["held_out_loss"] == pytest.approx(want, rel=1e-5)


def test_desync_variants_train_beside_the_schemes(experiment):
    """Desync patterns from scratch in the same `out` (the schemes' runs are reused): paired
    rows beside standard, and each trained checkpoint is the desync function the reference
    computes from its weights."""
    out, results, _ = experiment
    setting = pq.with_changes(TINY, desync=["every_layer", "final_only"], desync_tp=2)
    again = pq.run(setting, out, log=lambda m: None, trainer_out=io.StringIO(), adapt=False)
    scratch = {r["residual"]: r for r in again if r["kind"] == "scratch"}
    first = {r["residual"]: r for r in results if r["kind"] == "scratch"}
    assert scratch["standard"]["held_out_loss"] == first["standard"]["held_out_loss"]
    summary = {r["residual"]: r for r in again if r["kind"] == "summary"}
    tokens = np.arange(2 * 16).reshape(2, 16) % 256
    for p in ("every_layer", "final_only"):
        row, name = scratch[f"desync-{p}"], f"desync-{p}"
        assert row["desync_tp"] == 2 and len(row["curve"]) == TINY.steps
        assert abs(row["held_out_loss"] - first["standard"]["held_out_loss"]) > 1e-4
        want = row["held_out_loss"] - first["standard"]["held_out_loss"]
        assert summary[name]["vs_standard_loss"] == pytest.approx(want)
        cfg = OmegaConf.load(os.path.join(out, "runs", f"{name}-seed0", "config.yaml"))
        assert (cfg.model.residual, cfg.model.reduce_pattern) == ("desync", p)
        model, _ = lj.load(row["run"], mesh=mesh(1))
        ref = desync_reference.forward(
            nnx.to_pure_dict(nnx.state(model)), model.config, tokens, 2, p
        )
        np.testing.assert_allclose(np.asarray(logits(model, tokens)), ref, atol=5e-5, rtol=5e-5)
    assert "| desync-final_only |" in pq.table(again)
    assert len(pq.plots(again, out)) == 2


def test_held_out_documents_are_not_trained_on(experiment):
    out, _, _ = experiment
    train = "".join(
        p.read_text()
        for p in sorted((pathlib.Path(out) / "data" / "devils" / "train").glob("*.txt"))
    )
    held = [
        p.read_text() for p in (pathlib.Path(out) / "data" / "devils" / "held_out").glob("*.txt")
    ]
    assert len(held) > 50
    assert not [h for h in held if h in train]
    docs = corpora.documents("devils")
    assert docs[0][0] == "ABASEMENT" and len(docs) > 900


def test_kjv_corpus_is_held_out_by_book():
    docs = corpora.documents("kjv")
    assert len(docs) == 66 and docs[0][1].startswith("The First Book of Moses")
    train, held = corpora.split(docs)
    assert len(train) + len(held) == 66 and 4 <= len(held) <= 6
    assert not {t for t, _ in train} & {t for t, _ in held}
    assert sum(len(t) for _, t in docs) > 4_000_000


def test_cli_bad_input_is_one_line(capsys):
    cli = benchmark("paper_quality")
    for args, words in (
        (["--quick", "--set", "stepz=3"], "stepz"),
        (["--quick", "--set", "corpus=wiki"], "wiki"),
        (["--quick", "--set", "steps"], "FIELD=VALUE"),
    ):
        assert words in cli_error(capsys, cli.main, args)


def test_paper_notebook_executes(monkeypatch):
    # the quick setting on the shapes above (two seeds still, as the notebook's plots band them)
    nb = shrink(
        nbformat.read(NOTEBOOK, as_version=4),
        1,
        setting=f"pq.with_changes(pq.SETTINGS['quick'], **{NOTEBOOK_CHANGES!r})",
    )
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    client = NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()
    text = "\n".join(
        o.get("text", "") + "".join(o.get("data", {}).get("text/markdown", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "| ladder |" in text and "zero-shot" in text
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(images) == 2


@pytest.mark.parametrize(
    "difference, margin, within, want",
    [
        (0.0004, 0.008, None, "inconclusive"),  # the spread covers it: never "yes"
        (0.02, 0.008, None, "yes"),
        (-0.02, 0.008, None, "no"),
        (0.0004, 0.008, 0.0296, "yes"),  # a match: the whole interval inside +-3%
        (0.025, 0.008, 0.0296, "inconclusive"),  # the interval straddles the band's edge
        (0.05, 0.008, 0.0296, "no"),
    ],
)
def test_verdict_is_inconclusive_within_the_spread(difference, margin, within, want):
    assert pq.verdict(difference, margin, within=within) == want


def _summary(residual, mean, diff, diff_std):
    return {
        "kind": "summary",
        "residual": residual,
        "seeds": 3,
        "loss_mean": mean,
        "loss_std": 0.01,
        "vs_standard_loss": diff,
        "vs_standard_loss_std": diff_std,
        "ppl_mean": math.exp(mean),
        "paper_wikitext_ppl": {"1.2B": 0, "3.5B": 0},
    }


def test_a_claim_within_the_seed_spread_is_inconclusive():
    """parallel 0.0004 nats above standard with paired spreads 0.004 and 0.015 (margin 0.03):
    not a reproduction, whatever its sign; 0.05 nats above both is."""
    base = [_summary("standard", 2.0, 0.0, 0.0), _summary("ladder", 1.999, -0.001, 0.004)]
    close = pq.claims(base + [_summary("parallel", 2.0004, 0.0004, 0.015)])
    got = {c["claim"]: c["reproduces"] for c in close}
    assert got["parallel is worse than both"] == "inconclusive", close
    assert "margin 0.0300" in close[1]["measured"]
    far = pq.claims(base + [_summary("parallel", 2.05, 0.05, 0.015)])
    assert far[1]["reproduces"] == "yes"
    assert "| parallel is worse than both |" in pq.table(base + close)
    assert pq.table(base + close).splitlines()[-1].endswith("| inconclusive |")
