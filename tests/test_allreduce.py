"""`--allreduce`: the GPU programs built with XLA's one-shot all-reduce kernel (read from the
deviceless HLO), its costing (`collectives.time_collective`, `hardware.ALLREDUCE_KERNELS`), the
decision table, and the CPU programs it leaves unchanged."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

import ladder_jax as lj
from ladder_jax import hardware
from ladder_jax.analysis import collectives, compiled, hlo, overlap, perfmodel, programs, tables
from ladder_jax.analysis.kernels import Kernel
from ladder_jax.cli import decode as decode_cli
from ladder_jax.cli import overlap as overlap_cli
from ladder_jax.cli import predict as predict_cli
from ladder_jax.cli import serve as serve_cli
from ladder_jax.model import compilation
from tests.helpers import cli_error, predict_json, tiny_model

TINY = dict(phase="decode", tp=2, batch=1, seq=128, new_tokens=64)


def _op(op) -> str:
    """An instruction without its metadata (source lines differ between call sites)."""
    return re.sub(r", metadata=\{[^}]*\}", "", op.text)


def _report(residual, allreduce):
    config = lj.ModelConfig.from_preset("tiny", residual=residual)
    return overlap.report(config, **TINY, allreduce=allreduce)


@pytest.mark.parametrize("residual", ["standard", "ladder"])
def test_one_shot_option_gives_every_module_all_reduce_xla_s_kernel(residual):
    """Passed as a compile option, the one-shot flag leaves the scheduled program as it was (XLA
    annotates each all-reduce with the kernel it would take, TRITON_ONE_SHOT at these sizes,
    with the flag or without: the choice is made when the program is emitted for a GPU); the
    report names that kernel for each all-reduce of the one-shot program and NCCL for the
    default one. The schedule is the NCCL program's: standard's all-reduces stay blocking, the
    ladder's stay asynchronous with the next module's matmuls between start and done (all
    but the last)."""
    config = lj.ModelConfig.from_preset("tiny", residual=residual)
    kw = dict(TINY, seq=TINY["seq"])
    text = {
        a: programs.compile_program(config, **kw, allreduce=a)[0] for a in compilation.ALLREDUCES
    }
    entry = {a: [_op(op) for op in hlo.Module(t).entry] for a, t in text.items()}
    assert entry["nccl"] == entry["one_shot"]
    starts = [op for op in hlo.Module(text["nccl"]).entry if op.opcode == "all-reduce-start"]
    assert starts and all(op.kernel_strategy == "one_shot" for op in starts)
    nccl, one = _report(residual, "nccl"), _report(residual, "one_shot")
    modules = [r for r in one["all_reduces"] if r["kind"] == "module"]
    assert modules and {r["kernel"] for r in modules} == {"one_shot"}
    assert {r["kernel"] for r in nccl["all_reduces"]} == {"nccl"}
    assert one["forward"]["kernels"] == {"one_shot": len(modules)}
    assert [r["asynchronous"] for r in one["all_reduces"]] == [
        r["asynchronous"] for r in nccl["all_reduces"]
    ]
    assert one["forward"]["module_overlapped"] == nccl["forward"]["module_overlapped"]
    if residual == "ladder":
        assert one["forward"]["all_but_last_overlapped"]
        assert one["forward"]["module_overlapped"] == len(modules) - 1
    else:
        assert one["forward"]["module_overlapped"] == 0
    # the kernels the cost model reads: XLA's only where the program was compiled for them
    w = compiled.Workload(tp=2, batch=1, prompt_len=128, new_tokens=64)
    for a, want in (("nccl", {""}), ("one_shot", {"one_shot"})):
        ks = compiled.program_kernels(
            config, dataclasses.replace(w, allreduce=a), phase="decode"
        ).kernels
        assert {k.strategy for k in ks if k.collective == "all-reduce"} == want


def test_the_nccl_program_is_the_one_compiled_without_the_option():
    """`allreduce="nccl"` adds no option: the package's GPU options as before, and the program
    key (the compile cache) unchanged."""
    assert compilation.compiler_options("gpu", allreduce="nccl") == compilation.compiler_options(
        "gpu"
    )
    one = compilation.compiler_options("gpu", allreduce="one_shot")
    assert one["xla_gpu_unsupported_use_all_reduce_one_shot_kernel"] is True


def test_cpu_programs_ignore_the_option_and_logits_are_identical():
    """XLA:CPU has one all-reduce: the CPU options are the same, and a tp-2 forward compiled
    with each implementation gives the same logits, bit for bit."""
    assert compilation.compiler_options("cpu", allreduce="one_shot") == (
        compilation.compiler_options("cpu")
    )
    model = tiny_model(tp=2, residual="ladder")
    graphdef, state = nnx.split(model)
    tokens = jax.numpy.asarray(np.arange(16).reshape(2, 8) % 100)
    out = {
        a: np.asarray(
            compilation.jit(lambda s, t: nnx.merge(graphdef, s)(t), mesh=model.mesh, allreduce=a)(
                state, tokens
            )
        )
        for a in compilation.ALLREDUCES
    }
    np.testing.assert_array_equal(out["nccl"], out["one_shot"])
    assert np.isfinite(out["nccl"]).all()


def _kernel(nbytes, ranks=8, hosts=1, strategy="one_shot"):
    return Kernel(
        "start",
        "ar",
        nbytes=nbytes,
        collective="all-reduce",
        ranks=ranks,
        hosts=hosts,
        strategy=strategy,
    )


def test_one_shot_costed_by_its_formula_within_a_host_over_nvlink_only():
    cal = hardware.calibration("h100")
    nv, pcie = cal.links["nvlink"], cal.links["pcie"]
    one = cal.allreduce_kernels["one_shot"]
    s, lat, how = collectives.time_collective(_kernel(64e3), link=nv, calibration=cal)
    assert how == "one_shot" and lat == one.base_s
    assert s == pytest.approx(one.base_s + 7 * 64e3 / one.link_bytes_per_s, rel=1e-12)
    two = cal.allreduce_kernels["two_shot"]
    s2, _, how2 = collectives.time_collective(
        _kernel(2e6, strategy="two_shot"), link=nv, calibration=cal
    )
    assert how2 == "two_shot"
    assert s2 == pytest.approx(two.base_s + 2 * 7 / 8 * 2e6 / two.link_bytes_per_s, rel=1e-12)
    # P2P off and across hosts the kernel cannot reach its peers: NCCL's time
    for k, link in ((_kernel(64e3), pcie), (_kernel(64e3, ranks=16, hosts=2), nv)):
        nccl = collectives.time_collective(
            _kernel(k.nbytes, k.ranks, k.hosts, ""), link=link, calibration=cal
        )
        assert collectives.time_collective(k, link=link, calibration=cal) == nccl


def test_one_shot_model_within_the_measured_bound_and_below_nccl_at_decode_sizes():
    """XLA's estimator against the one public H100 measurement of a one-shot kernel (8 GPUs,
    host loop, so an upper bound: 5.7 us at 16 KB, 7.8 us at 128 KB), and below NCCL's best
    pick at the decode step's message sizes (16-256 KB)."""
    cal = hardware.calibration("h100")
    nv = cal.links["nvlink"]
    for nbytes, measured in ((16 * 1024, 5.7e-6), (128 * 1024, 7.8e-6)):
        s, _, _ = collectives.time_collective(_kernel(nbytes), link=nv, calibration=cal)
        assert s <= measured
    for nbytes in (16e3, 64e3, 256e3):
        one = collectives.time_collective(_kernel(nbytes), link=nv, calibration=cal)[0]
        nccl = collectives.time_collective(_kernel(nbytes, strategy=""), link=nv, calibration=cal)
        assert one < nccl[0], (nbytes, one, nccl)


def test_every_all_reduce_kernel_constant_names_its_source():
    for gen, kernels in hardware.ALLREDUCE_KERNELS.items():
        for name, k in kernels.items():
            assert k.name == name and k.base_s > 0 and k.link_bytes_per_s > 0
            assert "github.com/openxla/xla" in k.sources or "as the H100 entry" in k.sources
            assert "No end-to-end throughput was used" in k.sources, (gen, name)
            assert k.sources == hardware.SOURCES[f"ALLREDUCE_KERNELS.{gen}.{name}"]
    assert "sgl-project/sglang pull 2904" in hardware.SOURCES["ALLREDUCE_KERNELS.h100.one_shot"]


def test_decision_table_from_rows():
    def row(residual, allreduce, tps, link="nvlink"):
        return dict(
            residual=residual, allreduce=allreduce, tokens_per_s=tps, link=link, tp=8, batch=1
        )

    rows = [
        row("standard", "nccl", 100.0),
        row("standard", "one_shot", 120.0),
        row("ladder", "nccl", 125.0),
        row("ladder", "one_shot", 132.0),
        row("parallel", "nccl", 110.0),
        row("parallel", "one_shot", 118.0),
        row("upper_bound", "nccl", 140.0),
        row("upper_bound", "one_shot", 140.0),
    ]
    (d,) = tables.decision(rows)
    assert (d["standard"], d["standard_best"], d["ladder"], d["ladder_best"]) == (
        100.0,
        120.0,
        125.0,
        132.0,
    )
    assert d["parallel_best"] == 118.0 and d["upper_bound_best"] == 140.0
    assert d["ladder_buys"] == pytest.approx(1.1)
    assert d["standard_best_allreduce"] == "one_shot"
    text = tables.format_decision([d])
    assert "buys 1.100x over the best standard configuration (standard+one_shot)" in text


def test_predict_rows_name_the_implementation_and_nccl_rows_are_unchanged(capsys):
    argv = ["--preset", "tiny", "--tp", "2", "--batch", "1", "--prompt-len", "128"]
    argv += ["--new-tokens", "64", "--residual", "standard", "ladder", "--layers-compiled", "0"]
    nccl, _ = predict_json(capsys, argv)
    both, _ = predict_json(capsys, [*argv, "--allreduce", "nccl", "one_shot"])
    rows = [r for r in both if "decision" not in r]
    decisions = [r["decision"] for r in both if "decision" in r]
    assert {r["allreduce"] for r in rows} == {"nccl", "one_shot"}
    assert [r for r in rows if r["allreduce"] == "nccl"] == nccl
    one = {r["residual"]: r for r in rows if r["allreduce"] == "one_shot"}
    two = {r["residual"]: r for r in nccl}
    for residual in ("standard", "ladder"):  # tiny's messages are latency: the kernel is faster
        assert one[residual]["decode_step_s"] < two[residual]["decode_step_s"]
    (d,) = decisions
    assert d["standard"] == two["standard"]["tokens_per_s"]
    assert d["ladder_best"] == max(r["tokens_per_s"] for r in rows if r["residual"] == "ladder")
    json.dumps(d)


@pytest.mark.parametrize(
    "main, argv",
    [
        (predict_cli.main, ["--preset", "tiny", "--tp", "2", "--allreduce", "nccl", "ring"]),
        (overlap_cli.main, ["--preset", "tiny", "--tp", "2", "--allreduce", "ring"]),
        (decode_cli.main, ["--preset", "tiny", "--allreduce", "ring"]),
        (serve_cli.main, ["--preset", "tiny", "--allreduce", "ring"]),
    ],
)
def test_unknown_allreduce_is_one_line_exit_2(capsys, main, argv):
    line = cli_error(capsys, main, argv)
    assert "--allreduce 'ring': choose one of nccl, one_shot" in line


def test_sweep_refuses_an_unknown_allreduce_before_compiling():
    config = lj.ModelConfig.from_preset("tiny")
    with pytest.raises(perfmodel.PredictError, match="allreduce 'x'"):
        perfmodel.Sweep(tp=2, allreduces=("x",)).check(config)


def test_overlap_of_a_training_step_refuses_allreduce(capsys):
    argv = ["--config", "configs/tiny.yaml", "--allreduce", "one_shot"]
    assert "--allreduce one_shot is for decode and prefill" in cli_error(
        capsys, overlap_cli.main, argv
    )
