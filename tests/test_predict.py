"""The performance model: exact on hand-built schedules, physical on compiled ones, and the
few-layer extension equal to full-depth compiles. No timing is asserted: every number here is a
prediction computed from a schedule, so the tests are deterministic."""

import dataclasses
import functools
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

import ladder_jax as lj
from ladder_jax import hardware
from ladder_jax.analysis import perfmodel
from ladder_jax.cli import overlap as overlap_cli
from ladder_jax.cli import predict as predict_cli

# tiny, and a mid-size model whose weights dominate its decode step
TINY = lj.ModelConfig.from_preset("tiny")
MID = lj.ModelConfig.from_preset("small", d_model=512, n_heads=8, n_kv_heads=8, d_ff=2048,
                                 vocab_size=2048, n_layers=4, dtype="bfloat16",
                                 param_dtype="bfloat16")
SHAPE = dict(prompt_len=128, new_tokens=64)


# ---------------------------------------------------------------------------------------------
# Two streams, by hand.


def test_overlapped_collective_is_hidden():
    t = perfmodel.simulate([("compute", "a", 1.0, 0), ("start", "x", 2.0, 0),
                          ("compute", "b", 3.0, 1), ("done", "x", 0.0, None)])
    assert (t.seconds, t.compute_s, t.comm_s, t.exposed_comm_s) == (4.0, 4.0, 2.0, 0.0)


def test_collective_waited_on_at_once_is_exposed():
    t = perfmodel.simulate([("compute", "a", 1.0, 0), ("start", "x", 2.0, 0),
                          ("done", "x", 0.0, None), ("compute", "b", 3.0, 1)])
    assert (t.seconds, t.exposed_comm_s) == (6.0, 2.0)


def test_partly_hidden_and_queued_collectives():
    # x (3 s) overlaps b (1 s): 2 s exposed; y queues behind x on the collective stream
    t = perfmodel.simulate([("start", "x", 3.0, None), ("start", "y", 1.0, None),
                          ("compute", "b", 1.0, 0), ("done", "x", 0.0, None),
                          ("compute", "c", 0.5, 1), ("done", "y", 0.0, None)])
    assert t.seconds == 4.0 and t.compute_s == 1.5 and t.exposed_comm_s == 2.5
    t = perfmodel.simulate([("compute", "a", 1.0, 0), ("sync", "s", 2.0, None),
                          ("compute", "b", 3.0, 1)])
    assert (t.seconds, t.exposed_comm_s) == (6.0, 2.0)


def test_extension_adds_one_middle_layer_per_missing_layer():
    def layers(n):  # layer 0 is special (2 s), every later layer 1 s compute + 0.5 s exposed
        steps = [("compute", "l0", 2.0, 0)]
        for i in range(1, n):
            steps += [("compute", f"m{i}", 1.0, i), ("start", f"x{i}", 1.5, i),
                      ("done", f"x{i}", 0.0, i)]
        return steps + [("compute", "head", 0.25, None)]

    full = perfmodel.simulate(layers(7))
    seconds, compute = perfmodel.extended(perfmodel.simulate(layers(3)), perfmodel.simulate(layers(4)),
                                        7, 4)
    assert (seconds, compute) == (full.seconds, full.compute_s) == (2 + 6 * 2.5 + 0.25, 8.25)


def test_link_model_is_ring_latency_plus_bus_bandwidth():
    link = hardware.Link("l", "", base_latency_s=5e-6, hop_latency_s=1e-6,
                         bus_bytes_per_s=100e9, sources="")
    assert perfmodel.collective_seconds("all-reduce", 4e6, 8, link) == pytest.approx(
        5e-6 + 14e-6 + 4e6 * (14 / 8) / 100e9)
    assert perfmodel.collective_seconds("all-reduce", 0, 8, link, "tree") == pytest.approx(11e-6)
    assert perfmodel.collective_seconds("all-gather", 8e6, 4, link) == pytest.approx(
        5e-6 + 3e-6 + 8e6 * 0.75 / 100e9)
    assert perfmodel.collective_seconds("all-reduce", 4e6, 1, link) == 0.0


# ---------------------------------------------------------------------------------------------
# Reading a schedule: what a kernel moves and computes.

HLO = """HloModule m, is_scheduled=true, entry_computation_layout={()->f32[64,256]{1,0}}

%fused_dus (p0: bf16[4,1024], p1: bf16[4,1]) -> bf16[4,1024] {
  %p0 = bf16[4,1024]{1,0} parameter(0)
  %p1 = bf16[4,1]{1,0} parameter(1)
  %c = s32[] constant(0)
  ROOT %dus = bf16[4,1024]{1,0} dynamic-update-slice(%p0, %p1, %c, %c)
}

%fused_take (q0: bf16[1000,64], q1: s32[]) -> bf16[1,64] {
  %q0 = bf16[1000,64]{1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,64]{1,0} dynamic-slice(%q0, %q1, %z), dynamic_slice_sizes={1,64}
}

%gemm (g0: bf16[64,128], g1: bf16[128,256]) -> f32[64,256] {
  %g0 = bf16[64,128]{1,0} parameter(0)
  %g1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,256]{1,0} dot(%g0, %g1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[4,1024], b: bf16[4,1], e: bf16[1000,64], i: s32[], x: bf16[64,128], w: bf16[128,256]) -> f32[64,256] {
  %a = bf16[4,1024]{1,0} parameter(0)
  %b = bf16[4,1]{1,0} parameter(1)
  %e = bf16[1000,64]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %x = bf16[64,128]{1,0} parameter(4)
  %w = bf16[128,256]{1,0} parameter(5)
  %f1 = bf16[4,1024]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(step)/shard_map/layer0.attn/scatter"}
  %f2 = bf16[1,64]{1,0} fusion(%e, %i), kind=kLoop, calls=%fused_take
  %g = f32[64,256]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm, metadata={op_name="jit(step)/shard_map/layer1.mlp/dot_general"}
  %ars = f32[64,256]{1,0} all-reduce-start(%g), channel_id=1, replica_groups={{0,1}}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":false}}
  %f3 = bf16[4,1024]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_dus
  %ard = f32[64,256]{1,0} all-reduce-done(%ars)
  %ags = (f32[64,256]{1,0}, f32[128,256]{1,0}) all-gather-start(%ard), channel_id=2, dimensions={0}, backend_config={"collective_backend_config":{"is_sync":true}}
  ROOT %agd = f32[128,256]{1,0} all-gather-done(%ags)
}
"""


def test_read_kernels_counts_slices_updates_and_matmuls():
    ks = perfmodel.read_kernels(HLO)
    assert [(k.kind, k.name) for k in ks] == [
        ("compute", "f1"), ("compute", "f2"), ("compute", "g"), ("start", "ars"),
        ("compute", "f3"), ("done", "ars"), ("sync", "ags")]
    f1, f2, g, ars, _, _, ags = ks
    assert (f1.nbytes, f1.flops, f1.layer) == (4 * 2 + 4 * 2, 0, 0)  # update in + update out
    assert f2.nbytes == 4 + 64 * 2 + 64 * 2  # index, the sliced row, the result
    assert g.flops == 2 * 64 * 256 * 128 and g.layer == 1
    assert g.nbytes == 64 * 128 * 2 + 128 * 256 * 2 + 64 * 256 * 4
    assert (ars.collective, ars.nbytes) == ("all-reduce", 64 * 256 * 4)
    assert (ags.collective, ags.nbytes) == ("all-gather", 128 * 256 * 4)


# ---------------------------------------------------------------------------------------------
# Compiled programs (deviceless H100).


@functools.lru_cache(maxsize=None)
def _rows(config, tp, batch, residuals=perfmodel.RESIDUALS, links=("nvlink", "pcie"), **kw):
    return perfmodel.predict(config, tp=tp, batch=batch, links=links, residuals=residuals,
                           **SHAPE, **kw)


def _by(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def test_upper_bound_le_ladder_le_standard_and_slower_link_slower():
    for tp, batch in ((2, 1), (8, 4)):
        rows = _rows(TINY, tp, batch, ("standard", "ladder", "upper_bound"))
        for link in ("nvlink", "pcie"):
            t = {r["residual"]: r for r in _by(rows, link=link)}
            for key in ("prefill_s", "decode_step_s"):
                # upper_bound is a different program: XLA may fuse it into a kernel or two
                # more than the ladder, which matters only when nothing is left to hide
                slack = 2 * hardware.EFFICIENCY.kernel_overhead_s
                assert (t["upper_bound"][key] <= t["ladder"][key] + slack
                        and t["ladder"][key] < t["standard"][key]), (
                    tp, batch, link, key, {k: v[key] for k, v in t.items()})
            exposed = [t[r]["exposed_comm_s"] for r in ("upper_bound", "ladder", "standard")]
            assert exposed == sorted(exposed), (tp, batch, link, exposed)
        std = {r["link"]: r for r in _by(rows, residual="standard")}
        assert std["pcie"]["decode_step_s"] > std["nvlink"]["decode_step_s"]
        assert std["pcie"]["prefill_s"] > std["nvlink"]["prefill_s"]
        assert std["pcie"]["exposed_comm_s"] > std["nvlink"]["exposed_comm_s"] > 0
        for r in rows:  # the paper's count: the prefill emits the first token
            assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["new_tokens"] / (
                r["prefill_s"] + (r["new_tokens"] - 1) * r["decode_step_s"]))


def test_more_tp_means_less_compute_per_device():
    eff = dataclasses.replace(hardware.EFFICIENCY, kernel_overhead_s=0.0)
    compute = [perfmodel.program_time(MID, phase="decode", tp=tp, batch=4, **SHAPE,
                                    link=hardware.LINKS["nvlink"], efficiency=eff)["compute_s"]
               for tp in (2, 4, 8)]
    assert compute[0] > compute[1] > compute[2] > 0, compute


@pytest.mark.parametrize("config, residual", [
    (dataclasses.replace(TINY, n_layers=8), "ladder"),
    (dataclasses.replace(MID, n_layers=8), "standard"),
    (dataclasses.replace(MID, n_layers=8), "ladder")], ids=["tiny-ladder", "mid-standard",
                                                            "mid-ladder"])
def test_few_layers_extended_match_a_full_depth_compile(config, residual):
    cfg = dataclasses.replace(config, residual=residual)
    for link in ("nvlink", "pcie"):
        kw = dict(tp=8, batch=2, **SHAPE, link=hardware.LINKS[link],
                  efficiency=hardware.EFFICIENCY)
        for phase in ("prefill", "decode"):
            few = perfmodel.program_time(cfg, phase=phase, layers_compiled=4, **kw)
            full = perfmodel.program_time(cfg, phase=phase, layers_compiled=0, **kw)
            assert (few["layers_compiled"], full["layers_compiled"]) == ([3, 4], [8])
            assert few["seconds"] == pytest.approx(full["seconds"], rel=0.01), (phase, link)
            # compute alone may differ by a kernel XLA fused differently at one depth
            assert few["compute_s"] == pytest.approx(full["compute_s"], rel=0.02), (phase, link)


# ---------------------------------------------------------------------------------------------
# Command line.


def test_cli_json_rows(capsys):
    # the programs of the grid test above, from the compile cache
    argv = ["--preset", "tiny", "--tp", "2", "--batch", "1", "--prompt-len", "128",
            "--new-tokens", "64", "--link", "nvlink", "pcie", "--residual", "standard",
            "ladder", "--json"]
    assert predict_cli.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4 and {r["residual"] for r in rows} == {"standard", "ladder"}
    keys = {"residual", "tp", "batch", "prompt_len", "new_tokens", "link", "target",
            "prefill_s", "decode_step_s", "tokens_per_s", "tokens_per_s_per_user",
            "exposed_comm_s", "vs_standard"}
    assert all(keys <= set(r) for r in rows)
    assert all(r["tp"] == 2 and r["batch"] == 1 and r["tokens_per_s"] > 0 for r in rows)
    assert predict_cli.main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "ladder/standard" in out and "tokens/s" in out


def test_cli_train_step(capsys):
    config = pathlib.Path(__file__).parent.parent / "configs" / "tiny.yaml"
    argv = ["--phase", "train", "--config", str(config), "--tp", "2", "--link", "pcie",
            "--residual", "standard", "ladder", "--json"]
    assert predict_cli.main(argv) == 0
    rows = {r["residual"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    std, lad = rows["standard"], rows["ladder"]
    assert std["batch"] == 16 and std["seq_len"] == 128 and std["tp"] == 2
    assert std["tokens_per_s"] == pytest.approx(16 * 128 / std["step_s"])
    assert lad["step_s"] < std["step_s"] and lad["exposed_comm_s"] < std["exposed_comm_s"]


@pytest.mark.parametrize("args, message", [
    (["--preset", "llama-9"], "unknown preset 'llama-9'"),
    (["--preset", "tiny", "--link", "infiniband"], "unknown link 'infiniband': choose one of"),
    (["--preset", "tiny", "--target", "tpu"], "unknown target 'tpu': choose one of"),
    (["--preset", "tiny", "--tp", "3"], "n_heads=8 is not divisible by tp=3"),
    (["--preset", "tiny", "--residual", "sideways"], "unknown residual 'sideways'"),
    (["--preset", "tiny", "--batch", "0"], "batch=0 must be a positive integer"),
    (["--preset", "tiny", "--layers-compiled", "1"], "--layers-compiled 1: use 0"),
    (["--preset", "tiny", "--gemm-efficiency", "1.5"], "gemm efficiency 1.5 must be in"),
    (["--phase", "train"], "--phase train needs --config"),
    (["--phase", "train", "--config", "nope.yaml"], "config file 'nope.yaml' not found"),
    (["--phase", "serve"], "unknown phase 'serve'"),
])
def test_cli_bad_arguments_one_line_exit_2(capsys, args, message):
    assert predict_cli.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in captured.err, err


@pytest.mark.parametrize("main", [predict_cli.main, overlap_cli.main], ids=["predict", "overlap"])
def test_missing_cuda_plugin_is_one_line_with_the_install_hint(capsys, monkeypatch, main):
    def find_spec(name):  # what importlib does when the parent package is absent
        raise ModuleNotFoundError(f"No module named '{name.split('.')[0]}'")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    perfmodel.program_kernels.cache_clear()
    assert main(["--preset", "tiny", "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install "jax-cuda12-plugin==' in err[0], err


def test_python_m_ladder_jax_predict_and_lj_predict():
    """The module CLI (a fresh process: no runpy warning, one line) and the notebook call."""
    proc = subprocess.run([sys.executable, "-m", "ladder_jax.predict", "--preset", "llama-9"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    ours = [line for line in proc.stderr.splitlines() if "ladder_jax" in line or "error" in line]
    assert ours == [next(line for line in ours if line.startswith("error: unknown preset"))]
    assert "Traceback" not in proc.stderr and "RuntimeWarning" not in proc.stderr
    assert callable(lj.predict)
    rows = lj.predict("tiny", tp=2, batch=1, links="pcie", residuals=["standard", "ladder"],
                      **SHAPE)  # compiled above
    assert [(r["preset"], r["residual"], r["link"]) for r in rows] == [
        ("tiny", "standard", "pcie"), ("tiny", "ladder", "pcie")]
    assert rows[1]["vs_standard"] > 1
