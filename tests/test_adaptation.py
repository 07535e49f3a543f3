"""The adaptation experiment (ladder_jax.experiments.adaptation, benchmarks/adaptation.py) end
to end on a tiny trained base (the same code path as SmolLM2's, whose quick setting takes
minutes), distillation's loss against a hand computation, and bad input.

SmolLM2 itself, the quick setting: tests/test_adaptation_smollm2.py."""

import contextlib
import io
import json
import math
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest

import ladder_jax as lj
from ladder_jax.experiments import adaptation as ad
from ladder_jax.train import distill
from ladder_jax.train_config import check
from tests.helpers import benchmark, cli_error, logits, mesh

ROOT = pathlib.Path(__file__).parent.parent


def test_kl_matches_a_hand_computation():
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(2, 3, 7)) * 2, rng.normal(size=(2, 3, 7)) * 2
    mask = np.array([[1, 1, 0], [1, 0, 1]])
    temp = 2.0
    want = []
    for b in range(2):
        for i in range(3):
            p = np.exp(t[b, i] / temp) / np.exp(t[b, i] / temp).sum()
            q = np.exp(s[b, i] / temp) / np.exp(s[b, i] / temp).sum()
            want.append(temp**2 * float(np.sum(p * np.log(p / q))))
    got = float(distill.kl_divergence(s, t, mask, temperature=temp))
    ref = float(np.sum(np.array(want) * mask.ravel()) / mask.sum())
    assert math.isclose(got, ref, rel_tol=1e-5), (got, ref)
    assert float(distill.kl_divergence(t + 3.0, t)) == pytest.approx(0.0, abs=1e-6)


def test_distill_keys_are_checked():
    for bad, word in (
        ({"distill__weight": 1.5}, "distill.weight"),
        ({"distill__temperature": 0.0}, "distill.temperature"),
    ):
        with pytest.raises(lj.ConfigError, match=word):
            check(lj.api.fit_config(None, **bad))


# One conversion, distillation only (LM fine-tuning is the trainer's own path), no generated
# text (the chat answers run the same `generate`): every distinct model graph compiles its
# training step, scorer, decoder and loss once, so the test keeps to two graphs.
TINY = dict(
    ladder_layers=(2,),
    recover_layers=2,
    methods=("distill",),
    control=True,
    steps=2,
    batch_size=2,
    grad_accum=1,
    seq_len=32,
    tasks=("arc_easy",),
    eval_limit=2,
    eval_batch=8,
    held_out_records=2,
    chat_tokens=2,
    sources=("devils", "kjv", "stdlib"),
    source_bytes=3000,
    remat="none",
)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("adaptation"))
    with contextlib.redirect_stdout(io.StringIO()):
        base = lj.fit(
            None,
            name="base",
            run_dir=os.path.join(out, "base"),
            steps=20,
            seed=0,
            log_every=10**9,
            eval_every=0,
            ckpt_every=0,
            keep=1,
            async_ckpt=False,
            progress="none",
            tensorboard=False,
            model__preset="tiny",
            data__seq_len=64,
            data__batch_size=8,
            data__eval_fraction=0.0,
            optim__peak_lr=3e-3,
            optim__warmup_steps=2,
            mesh__tp=1,
            mesh__data=1,
        )
    setting = ad.with_changes(ad.SETTINGS["quick"], base=base.path, **TINY)
    emitted = []
    results = ad.run(
        setting,
        os.path.join(out, "exp"),
        emit=emitted.append,
        log=lambda m: None,
        trainer_out=io.StringIO(),
    )
    return out, setting, results, emitted


def _model(results, name):
    return next(r for r in results if r["kind"] == "model" and r["name"] == name)


def test_every_model_and_claim_is_there(experiment):
    out, s, results, emitted = experiment
    assert emitted == results
    with open(os.path.join(out, "exp", "results.json")) as f:
        assert json.load(f) == json.loads(json.dumps(results))
    names = {r["name"] for r in results if r["kind"] == "model"}
    assert names == {"original", "ladder2 zero-shot", "ladder2 distill", "standard distill"}
    for r in results:
        if r["kind"] == "model":
            assert set(r["tasks"]) == {"arc_easy"} and r["tasks"]["arc_easy"]["docs"] == 2
            assert set(r["held_out"]) == {"devils", "kjv", "stdlib"}
            assert all(math.isfinite(v["loss"]) for v in r["held_out"].values())
            assert list(r["chat"]) == list(ad.QUESTIONS)
    claims = [r for r in results if r["kind"] == "claim"]
    assert len(claims) == 2  # zero-shot hurts, the recovery
    assert all(c["reproduces"] in ("yes", "no", "inconclusive") for c in claims)
    text = ad.table(results)
    assert "| ladder2 zero-shot |" in text and "reproduces" in text
    paths = ad.plots(results, out)
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_conversion_changes_the_model_and_zero_layers_do_not(experiment):
    out, s, results, _ = experiment
    model, _ = lj.load(os.path.join(out, "base", "base"), mesh=mesh(1))
    tokens = np.arange(1, 33, dtype=np.int32)[None] % 250
    ref = np.asarray(logits(model, tokens))
    same = np.asarray(logits(lj.with_config(model, residual="ladder", ladder_layers=0), tokens))
    two = np.asarray(logits(lj.with_config(model, residual="ladder", ladder_layers=2), tokens))
    np.testing.assert_allclose(same, ref, rtol=1e-5, atol=1e-5)
    assert np.abs(two - ref).max() > 1e-3
    orig, zs = _model(results, "original"), _model(results, "ladder2 zero-shot")
    assert orig["held_out"]["devils"]["loss"] != zs["held_out"]["devils"]["loss"]


def test_desync_zero_shot_rows_sit_beside_the_ladder_ones(experiment):
    """The base rewired as residual="desync" (2 streams), zero-shot: one row per pattern in a
    stage of its own, a different function from the original, and the claims unchanged."""
    out, s, results, _ = experiment
    setting = ad.with_changes(s, desync=["every_layer", "final_only"], desync_tp=2)
    exp = ad.Experiment(setting, os.path.join(out, "exp"), log=lambda m: None)
    exp.write_data()
    rows = exp.zero_shot()
    by = {r["name"]: r for r in rows}
    assert list(by) == [
        "original",
        "ladder2 zero-shot",
        "desync-every_layer zero-shot",
        "desync-final_only zero-shot",
    ]
    losses = {n: r["held_out"]["devils"]["loss"] for n, r in by.items()}
    assert len(set(losses.values())) == 4, losses
    assert all(by[n]["stage"] == "desync zero-shot" for n in list(by)[2:])
    claims = ad.claims([*results, *rows[2:]])
    assert [c["claim"] for c in claims] == [c["claim"] for c in ad.claims(results)]
    assert "| desync-final_only zero-shot |" in ad.table([*results, *rows[2:]])


def test_held_out_loss_matches_a_plain_forward(experiment):
    out, s, results, _ = experiment
    model, tok = lj.load(os.path.join(out, "base", "base"), mesh=mesh(1))
    from ladder_jax.train import data

    toks = data.load_tokens(os.path.join(out, "exp", "data", "sources", "devils", "held_out"), tok)
    recs, _ = data.split(np.asarray(toks), s.seq_len, 0.0)
    x = np.asarray(recs[0])[None]
    lp = jax.nn.log_softmax(np.asarray(logits(model, x[:, :-1])), axis=-1)
    want = -float(np.mean(np.take_along_axis(lp, x[:, 1:, None], -1)))
    got = _model(results, "original")["held_out"]["devils"]["records"][0]
    assert got == pytest.approx(want, rel=1e-4)


def test_distillation_starts_at_zero_from_the_teacher_itself(experiment):
    _, _, results, _ = experiment
    # the control starts as the teacher: KL 0 up to rounding; the converted student does not
    # (a tiny model's upper modules write little, so its KL is small, but far above rounding)
    same = abs(_model(results, "standard distill")["curve"][0])
    assert same < 1e-7
    assert _model(results, "ladder2 distill")["curve"][0] > max(10 * same, 1e-8)


def test_cli_bad_input_is_one_line(capsys):
    cli = benchmark("adaptation")
    for args, words in (
        (["--quick", "--set", "stepz=3"], "stepz"),
        (["--quick", "--set", "methods=[finetune]"], "finetune"),
        (["--quick", "--set", "generated_docs=3"], "generated_docs"),
        (["--quick", "--set", "base=/nonexistent"], "/nonexistent"),
    ):
        assert words in cli_error(capsys, cli.main, args + ["--out", "/nonexistent/x"])


class _Texts(ad.Experiment):
    """An experiment's data step over given documents, byte tokens and no model."""

    def __init__(self, setting, out, docs):
        self.s, self.out, self.docs = setting, out, docs

    def mix_documents(self):
        return self.docs

    def tokenizer_file(self):
        return "byte"


def test_a_held_out_part_shorter_than_a_record_is_trained_on_not_measured(tmp_path):
    """Held-out text of seq_len tokens (no full record) is listed under held_out_too_short and
    left out of the measured sources, its training documents still in the mix; seq_len + 1
    tokens is one record, measured. Byte tokens: a document's bytes plus BOS and EOS."""
    seq = 32
    docs = {  # 12 documents a source: corpora.split holds out the 7th
        "short": [(f"s{i}", "s" * (seq - 2 if i == 6 else 10)) for i in range(12)],
        "one_record": [(f"r{i}", "r" * (seq - 1 if i == 6 else 20)) for i in range(12)],
    }
    setting = ad.Setting("t", seq_len=seq)
    exp = _Texts(setting, str(tmp_path), docs)
    row = exp.write_data()
    assert row["held_out_too_short"] == {"short": seq}
    assert {k: len(v) for k, v in exp.held_out.items()} == {"one_record": seq + 1}
    assert row["held_out_tokens"] == {"one_record": seq + 1}
    assert row["train_tokens_available"] == 11 * (10 + 2) + 11 * (20 + 2)
    names = sorted(os.listdir(exp.train_dir))
    assert sum(n.startswith("short_") for n in names) == 11, names
    with pytest.raises(lj.ConfigError, match="every source's held-out text is shorter"):
        _Texts(setting, str(tmp_path / "b"), {"short": docs["short"]}).write_data()


def test_a_copied_output_directory_gets_its_mix_links_back(tmp_path):
    """The mix links to data/sources by absolute path: after the output directory is copied
    elsewhere (its links dangling or pointing into the old copy) write_data points them at
    the new copy's sources again."""
    docs = {"a": [(f"a{i}", "a" * 40) for i in range(12)]}
    setting = ad.Setting("t", seq_len=8)
    _Texts(setting, str(tmp_path / "old"), docs).write_data()
    shutil.copytree(tmp_path / "old", tmp_path / "new", symlinks=True)
    shutil.rmtree(tmp_path / "old")
    exp = _Texts(setting, str(tmp_path / "new"), docs)
    row = exp.write_data()
    links = [os.path.join(exp.train_dir, n) for n in os.listdir(exp.train_dir)]
    assert len(links) == 11
    assert all(os.readlink(p).startswith(str(tmp_path / "new")) for p in links), links
    assert row["train_tokens_available"] == 11 * (40 + 2)


def test_a_measured_model_row_is_reused_only_with_the_same_setting(tmp_path):
    """save_row / load_row: the row comes back for the same setting, not for a changed one,
    and an unfinished write (its .tmp file) is never read."""
    setting = ad.Setting("t", seq_len=8)
    row = {"kind": "model", "name": "ladder4 zero-shot", "avg": 0.5, "held_out": {}}
    assert ad.load_row(str(tmp_path), row["name"], setting) is None
    ad.save_row(str(tmp_path), row, setting)
    assert ad.load_row(str(tmp_path), row["name"], setting) == row
    assert ad.load_row(str(tmp_path), row["name"], ad.with_changes(setting, steps=2)) is None
    assert ad.load_row(str(tmp_path), "original", setting) is None
    path = ad.row_path(str(tmp_path), row["name"])
    os.replace(path, path + ".tmp")
    assert ad.load_row(str(tmp_path), row["name"], setting) is None


def _row(name, stage, avg, se, loss, loss_se, k=15, method=None):
    return {
        "kind": "model",
        "name": name,
        "stage": stage,
        "method": method,
        "ladder_layers": k,
        "n_layers": 30,
        "avg": avg,
        "avg_se": se,
        "tokens": 1000,
        "held_out": {"a": {"loss": loss, "se": loss_se}},
    }


@pytest.mark.parametrize(
    "zero_shot_avg, want", [(0.40, "yes"), (0.55, "inconclusive"), (0.70, "no")]
)
def test_claims_are_never_yes_within_two_standard_errors(zero_shot_avg, want):
    rows = [
        _row("original", "original", 0.56, 0.02, 3.0, 0.01, k=0),
        _row("z", "zero-shot", zero_shot_avg, 0.02, 3.5, 0.01),
    ]
    (hurt,) = ad.claims(rows)
    assert hurt["reproduces"] == want, hurt  # margin 2 x hypot(2, 2) = 5.7 points


def test_claims_fall_back_to_held_out_loss_without_tasks():
    rows = [
        _row("original", "original", None, None, 3.0, 0.05, k=0),
        _row("z", "zero-shot", None, None, 3.5, 0.05),
        _row("lm", "recovered", None, None, 3.2, 0.05, method="lm"),
        _row("d", "recovered", None, None, 3.05, 0.05, method="distill"),
    ]
    got = [(c["claim"].split(" (")[0], c["reproduces"]) for c in ad.claims(rows)]
    # margin 2 x hypot(0.05, 0.05) = 0.14 nats: LM stays 0.2 above the original, distillation
    # comes within it and 0.45 below zero-shot, and beats LM by 0.15
    assert got == [
        ("converting the upper 15 of 30 zero-shot hurts", "yes"),
        ("recovery", "no"),
        ("recovery", "yes"),
        ("distillation recovers more per token than LM fine-tuning", "yes"),
    ]


def test_the_notebook_is_committed_executed():
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "adaptation.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("outputs") for c in code)
    assert sum("image/png" in o.get("data", {}) for c in code for o in c.outputs) == 2


def test_paired_standard_error_matches_a_hand_computation():
    # differences 0, 1, 0, 0: mean 1/4, population variance 3/16, over 4 documents
    a, b = [1, 1, 0, 1], [1, 0, 0, 1]
    assert ad.paired_se(a, b, ddof=0) == pytest.approx(math.sqrt(3 / 16) / 2)
    # records: differences 0.1, 0.3, 0.2: sample sd 0.1, over 3 records
    assert ad.paired_se([2.1, 2.5, 2.4], [2.0, 2.2, 2.2], ddof=1) == pytest.approx(0.1 / 3**0.5)
    assert ad.paired_se(a, a, ddof=0) == 0.0


def test_claims_pair_the_models_on_the_same_documents():
    """The converted model gets 4 of the original's 24 right documents wrong and nothing else
    changes: -10 points, 2 paired SE 200 x sqrt(0.1 x 0.9 / 40) = 9.5 ("yes"), where the two
    binomial errors combined give 22.1 ("inconclusive", what rows without per-document
    outcomes still get, marked unpaired)."""
    orig = [1] * 24 + [0] * 16
    conv = [1] * 20 + [0] * 20
    rows = [
        _row("original", "original", 0.6, math.sqrt(0.6 * 0.4 / 40), 3.0, 0.1, k=0),
        _row("z", "zero-shot", 0.5, math.sqrt(0.5 * 0.5 / 40), 3.0, 0.1),
    ]
    for r, c in zip(rows, (orig, conv)):
        r["tasks"] = {"t": {"acc": sum(c) / 40, "se": r["avg_se"], "docs": 40, "correct": c}}
    (hurt,) = ad.claims(rows)
    assert "(-10.0 ± 9.5)" in hurt["measured"], hurt["measured"]
    assert hurt["reproduces"] == "yes"
    for r in rows:
        del r["tasks"]["t"]["correct"]
    (hurt,) = ad.claims(rows)
    assert "(-10.0 ± 22.1, unpaired)" in hurt["measured"], hurt["measured"]
    assert hurt["reproduces"] == "inconclusive"


def test_held_out_claims_pair_the_records():
    """Losses over the same three records: the converted model is 0.1, 0.3, 0.2 nats worse
    on them (2 paired SE 2 x 0.1 / sqrt 3 = 0.115), though the records themselves spread by
    a whole nat (unpaired margin 1.68)."""
    a, b = [2.0, 3.0, 4.0], [2.1, 3.3, 4.2]
    rows = [
        _row("original", "original", None, None, 3.0, 1 / 3**0.5, k=0),
        _row("z", "zero-shot", None, None, 3.2, np.std(b, ddof=1) / 3**0.5),
    ]
    rows[0]["held_out"]["a"]["records"], rows[1]["held_out"]["a"]["records"] = a, b
    (hurt,) = ad.claims(rows)
    assert "(+0.200 ± 0.115) nats" in hurt["measured"], hurt["measured"]
    assert hurt["reproduces"] == "yes"


def test_report_recomputes_the_claims_from_the_stored_rows(tmp_path, capsys):
    """`--report` on a results.json whose claim was written by older code (an unpaired
    margin): the claim comes back recomputed, paired over the stored records, in the file and
    the printed table; the model rows stay as they were."""
    rows = [
        _row("original", "original", None, None, 3.0, 1 / 3**0.5, k=0),
        _row("z", "zero-shot", None, None, 3.2, 0.6),
    ]
    for r, rec in zip(rows, ([2.0, 3.0, 4.0], [2.1, 3.3, 4.2])):
        r.update(tasks={}, chat={"q": "a"})
        r["held_out"]["a"]["records"] = rec
    stale = {"kind": "claim", "claim": "old", "paper": "-", "measured": "-", "reproduces": "x"}
    done = {"kind": "done", "setting": "t", "wall_s": 1.0, "peak_rss_gb": 1.0}
    (tmp_path / "results.json").write_text(json.dumps([*rows, stale, done]))
    assert benchmark("adaptation").main(["--report", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "results.json").read_text())
    assert got[:2] == rows and got[-1] == done
    (claim,) = [r for r in got if r["kind"] == "claim"]
    assert "(+0.200 ± 0.115) nats" in claim["measured"] and claim["reproduces"] == "yes"
    assert "(+0.200 ± 0.115) nats" in capsys.readouterr().out


def test_cli_refuses_an_unknown_task_before_any_work(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(ad, "run", lambda *a, **k: pytest.fail("the experiment started"))
    line = cli_error(
        capsys,
        benchmark("adaptation").main,
        ["--quick", "--set", "tasks=[arc_easy,nope]", "--out", str(tmp_path / "x")],
    )
    assert "no task 'nope'" in line and "arc_easy" in line, line
    assert not (tmp_path / "x").exists()


def test_cli_interrupted_names_what_stopped(capsys, monkeypatch, tmp_path):
    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ad, "run", stop)
    cli = benchmark("adaptation")
    assert cli.main(["--quick", "--out", str(tmp_path / "x")]) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("stopped (interrupted): run the same command again"), err


@pytest.mark.parametrize(
    "content",
    ["{}", "[]", '[{"kind": "done"}]', '[{"kind": "model"}, 3]', "not json", '[{"kind": "model"}]'],
)
def test_report_on_a_file_that_is_not_results_is_one_line_and_touches_nothing(
    capsys, tmp_path, content
):
    (tmp_path / "results.json").write_text(content)
    before = os.stat(tmp_path / "results.json").st_mtime_ns
    line = cli_error(capsys, benchmark("adaptation").main, ["--report", "--out", str(tmp_path)])
    assert "results.json" in line, line
    assert (tmp_path / "results.json").read_text() == content
    assert os.stat(tmp_path / "results.json").st_mtime_ns == before
    assert sorted(os.listdir(tmp_path)) == ["results.json"]  # no plots written
