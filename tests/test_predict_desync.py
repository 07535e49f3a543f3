"""Desync Residual in the performance model and the overlap report: its compiled programs'
all-reduces per reduce pattern, its predict rows beside the other schemes, and the two-layer
period of every_2_layers extended to full depth as a full-depth compile costs it."""

import dataclasses

import pytest

import ladder_jax as lj
from ladder_jax import hardware
from ladder_jax.analysis import compiled, perfmodel
from ladder_jax.analysis.compiled import Workload
from ladder_jax.analysis.perfmodel import Costing
from ladder_jax.cli import overlap as overlap_cli
from ladder_jax.cli import predict as predict_cli
from ladder_jax.config import REDUCE_PATTERNS, RESIDUALS
from tests.helpers import cli_error, flags, predict_json

TINY = lj.ModelConfig.from_preset("tiny")
CLI = dict(preset="tiny", tp=2, batch=1, prompt_len=128, new_tokens=64, link=["nvlink", "pcie"])
SYNCED = {"every_layer": 4, "every_2_layers": 2, "final_only": 1}  # tiny's 4 layers


@pytest.mark.parametrize("pattern", REDUCE_PATTERNS)
def test_overlap_cli_counts_one_all_reduce_per_synced_module(capsys, pattern):
    argv = ["--preset", "tiny", "--tp", "2", "--phase", "decode", "--reduce-pattern", pattern]
    assert overlap_cli.main([*argv, "--residual", "desync", "--json"]) == 0
    rep = __import__("json").loads(capsys.readouterr().out)
    config = dataclasses.replace(TINY, residual="desync", reduce_pattern=pattern)
    want = [(i, "mlp") for i, (_, mlp) in enumerate(config.desync_syncs()) if mlp]
    got = [(r["layer"], r["module"]) for r in rep["all_reduces"] if r["kind"] == "module"]
    assert got == want and len(got) == SYNCED[pattern], rep["all_reduces"]
    assert rep["residual"] == "desync"


def test_overlap_cli_refuses_a_bad_pattern_in_one_line(capsys):
    argv = ["--preset", "tiny", "--tp", "2", "--reduce-pattern", "every_3_layers"]
    assert "--reduce-pattern 'every_3_layers'" in cli_error(capsys, overlap_cli.main, argv)
    argv = ["--preset", "tiny", "--tp", "2", "--residual", "ladder", "--desync-tp", "2"]
    assert "--desync-tp applies to --residual desync" in cli_error(capsys, overlap_cli.main, argv)


@pytest.mark.parametrize(
    "n_layers, pattern, depths",
    [
        (8, "every_layer", [3, 4]),
        (8, "final_only", [3, 4]),
        (8, "every_2_layers", [2, 4]),
        (7, "every_2_layers", [3, 5]),
        (5, "every_2_layers", [5]),
        (4, "every_2_layers", [4]),
        (4, ((False, True), (False, False), (False, False), (False, True)), [4]),
    ],
)
def test_compiled_depths_difference_over_whole_periods(n_layers, pattern, depths):
    config = dataclasses.replace(TINY, n_layers=n_layers, residual="desync", reduce_pattern=pattern)
    assert compiled.compiled_depths(config, 4) == depths
    assert compiled.compiled_depths(dataclasses.replace(TINY, n_layers=n_layers), 4) == (
        [3, 4] if n_layers > 4 else [n_layers]
    )


@pytest.mark.parametrize("n_layers", [8, 7])
def test_every_2_layers_extended_matches_a_full_depth_compile(n_layers):
    """Syncs alternate, so a one-layer difference (3 vs 4 layers: two syncs each) would
    extend with no all-reduce at all (7% short on the decode step here); over a two-layer
    period the decode step is the full depth's."""
    cfg = dataclasses.replace(
        TINY, n_layers=n_layers, residual="desync", reduce_pattern="every_2_layers"
    )
    cal = dataclasses.replace(hardware.calibration("h100"), efficiency=hardware.EFFICIENCY)
    w = Workload(tp=2, batch=1, prompt_len=128, new_tokens=64)
    for link in ("nvlink", "pcie"):
        for phase in ("prefill", "decode"):
            few, full = (
                perfmodel.program_time(
                    cfg, w, Costing(hardware.LINKS[link], cal, layers_compiled=n), phase=phase
                )
                for n in (4, 0)
            )
            assert full["layers_compiled"] == [n_layers] and len(few["layers_compiled"]) == 2
            # tiny's whole prefill is ~0.3 ms, where one kernel fused differently at one depth
            # is a few percent of it
            rel = 0.01 if phase == "decode" else 0.05
            assert few["seconds"] == pytest.approx(full["seconds"], rel=rel), (phase, link)
            if phase == "decode":
                assert few["exposed_comm_s"] == pytest.approx(full["exposed_comm_s"], rel=0.02)


def test_predict_rows_per_pattern_within_the_physical_bounds(capsys):
    rows, _ = predict_json(capsys, flags(**CLI, residual=["upper_bound", "desync"]))
    for link in CLI["link"]:
        mine = [r for r in rows if r["link"] == link]
        desync = {r["reduce_pattern"]: r for r in mine if r["residual"] == "desync"}
        (bound,) = [r for r in mine if r["residual"] == "upper_bound"]
        assert set(desync) == set(REDUCE_PATTERNS) and len(mine) == 4
        assert "reduce_pattern" not in bound
        for r in desync.values():
            assert r["desync_tp"] == r["tp"] == 2
            # upper_bound: the same layers with no all-reduce at all
            assert r["tokens_per_s"] <= bound["tokens_per_s"], r["reduce_pattern"]
            assert r["exposed_comm_s"] >= bound["exposed_comm_s"]
            assert r.get("above_upper_bound") is None
        # fewer all-reduces expose no more communication
        exposed = [desync[p]["decode_step_exposed_comm_s"] for p in REDUCE_PATTERNS]
        assert exposed == sorted(exposed, reverse=True), exposed


def test_predict_text_names_each_pattern(capsys):
    argv = [*flags(**CLI, residual="desync", reduce_pattern=["final_only", "ny,nn,nn,ny"])]
    assert predict_cli.main(argv) == 0
    out = capsys.readouterr().out
    table = out.split("decode step vs")[0]
    assert table.count("desync/end") == 2 and table.count("desync/own") == 2, out
    assert "desync/1L" not in table and "desync/end: the last layer's only" in out


def test_residual_all_keeps_the_four_schemes(capsys):
    """`--residual all` is the four schemes as before: no desync row, no desync key; desync
    beside them changes none of their rows."""
    base = flags(**{**CLI, "link": "nvlink"})
    rows, _ = predict_json(capsys, base)
    assert [r["residual"] for r in rows] == list(RESIDUALS)
    assert not any("reduce_pattern" in r or "desync_tp" in r for r in rows)
    both, _ = predict_json(capsys, [*base, "--residual", "all", "desync"])
    assert both[: len(RESIDUALS)] == rows
    assert [r["residual"] for r in both[len(RESIDUALS) :]] == ["desync"] * 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--residual", "desync", "--reduce-pattern", "bogus"], "--reduce-pattern 'bogus'"),
        (["--reduce-pattern", "final_only"], "--reduce-pattern applies to desync"),
        (["--residual", "desync", "--quantize", "int8"], "desync decodes float weights only"),
        (["--residual", "desync", "--reduce-pattern", "ny,ny"], "give 4 [attention, mlp] pairs"),
        (["--residual", "dsync"], "unknown residual 'dsync'"),
    ],
)
def test_predict_refuses_in_one_line(capsys, argv, message):
    assert message in cli_error(capsys, predict_cli.main, [*flags(**CLI), *argv])


def test_train_rows_per_pattern(capsys):
    argv = ["--phase", "train", "--config", "configs/tiny.yaml", "--tp", "2", "--link", "nvlink"]
    rows, _ = predict_json(capsys, [*argv, "--residual", "upper_bound", "desync"])
    desync = {r["reduce_pattern"]: r for r in rows if r["residual"] == "desync"}
    (bound,) = [r for r in rows if r["residual"] == "upper_bound"]
    assert set(desync) == set(REDUCE_PATTERNS)
    assert all(r["desync_tp"] == 2 and r["step_s"] >= bound["step_s"] for r in desync.values())
    assert predict_cli.main([*argv, "--residual", "desync"]) == 0
    assert "desync/2L" in capsys.readouterr().out


def test_lj_predict_takes_desync_and_its_patterns():
    rows = lj.predict(
        "tiny",
        tp=2,
        batch=1,
        prompt_len=128,
        new_tokens=64,
        links="nvlink",
        residuals=("desync",),
        reduce_patterns=("final_only",),
        progress=None,
    )
    assert [(r["residual"], r["reduce_pattern"], r["desync_tp"]) for r in rows] == [
        ("desync", "final_only", 2)
    ]
    assert "desync/end" in repr(rows)
