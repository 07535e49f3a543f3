"""Training at scale, proven without GPUs: the training step a config runs, compiled deviceless
for several hosts of H100s (`python -m ladder_jax.overlap --config ... --hosts N`), its
schedule and its memory; and the memory check the trainer makes before its first step.

Compiling for a CUDA target needs the CUDA PJRT plugin (a test extra); nothing runs on a GPU.
"""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

import ladder_jax as lj
from ladder_jax.analysis import overlap, programs
from ladder_jax.cli import overlap as overlap_cli
from ladder_jax.cli import train as train_cli
from ladder_jax.model import compilation
from ladder_jax.train import step, trainer
from ladder_jax.train_config import load_config
from tests.helpers import SCHEMES, TINY, loss_and_grads

# tiny, ladder, FSDP over 2 hosts (data 2) x 4 GPUs (tp 4), remat, 2 accumulated micro-batches
TINY_SCALE = [
    "configs/tiny.yaml",
    "model.residual=ladder",
    "model.n_kv_heads=8",
    "model.remat=module",
    "mesh.tp=4",
    "mesh.data=2",
    "mesh.fsdp=true",
    "data.batch_size=4",
    "data.grad_accum=2",
    "data.seq_len=128",
]
# ... and a model that cannot fit one H100: a replicated 2M x 4096 fp32 embedding (33 GB) with
# its two AdamW moments is over 80 GB before any activation
TOO_BIG = [
    "model.vocab_size=2000000",
    "model.d_model=4096",
    "mesh.fsdp=false",
    "data.grad_accum=1",
    "data.seq_len=8",
    "model.max_seq_len=8",
]


@functools.lru_cache(maxsize=None)
def _report():
    return overlap.report_config(load_config(TINY_SCALE), hosts=2, gpus_per_host=4)


def test_two_hosts_fsdp_remat_step_keeps_the_ladder_overlap():
    rep = _report()
    assert (rep["gpus"], rep["data"], rep["tp"], rep["fsdp"]) == (8, 2, 4, True)
    for pass_, n in (("forward", 8), ("backward", 9)):  # backward: the head, then 8 modules
        ars = [
            r for r in rep["all_reduces"] if r["pass"] == pass_ and r["kind"] in ("module", "head")
        ]
        assert len(ars) == n, [(r["layer"], r["module"]) for r in ars]
        assert all(r["overlapped"] for r in ars[:-1]), [r["gemms_between"] for r in ars]
        assert rep[pass_]["all_but_last_overlapped"]


def test_one_gradient_norm_all_reduce_and_no_gathers_in_the_update():
    rep = _report()
    assert rep["by_kind"]["optimizer"]["total"] == 1
    norm = [r for r in rep["all_reduces"] if r["kind"] == "optimizer"]
    assert norm[0]["bytes"] == 4
    # outside the accumulation loop: that one all-reduce (over every device) and nothing else;
    # clipping and AdamW run on each device's FSDP blocks as stored
    per_step = [r for r in rep["collectives"] if r["where"] == "step"]
    assert per_step == [
        {
            "collective": "all-reduce",
            "axis": "all",
            "where": "step",
            "count": 1,
            "overlapped": 0,
            "bytes": 4,
        }
    ], per_step
    # inside it: FSDP gathers weights over data and reduce-scatters their gradients
    loop = {(r["collective"], r["axis"]) for r in rep["collectives"] if r["where"] == "loop"}
    assert {("all-gather", "data"), ("reduce-scatter", "data"), ("all-reduce", "tp")} <= loop


def test_tp_groups_stay_inside_a_host():
    mesh = programs.gpu_mesh("h100", 4, data=2, hosts=2)
    for row in mesh.devices:
        assert len({d.process_index for d in row}) == 1
    assert {d.process_index for d in mesh.devices[:, 0]} == {0, 1}


def test_memory_report_and_check(capsys):
    args = [
        "--config",
        "configs/tiny.yaml",
        "--hosts",
        "2",
        "--gpus-per-host",
        "4",
        *TINY_SCALE[1:],
    ]
    assert overlap_cli.main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["peak_bytes_per_device"] < out["device_memory_bytes"] == 80 * 1024**3
    m = out["memory"]
    assert (
        m["arguments"] + m["temporaries"]
        <= m["peak"]
        <= (m["arguments"] + m["temporaries"] + m["outputs"] - m["aliased"] + 2**20)
    )
    # the same model with a huge replicated embedding: refused, one line, naming FSDP first
    assert (
        overlap_cli.main(
            [
                "--config",
                "configs/tiny.yaml",
                "--hosts",
                "1",
                "--gpus-per-host",
                "4",
                "mesh.tp=4",
                *TOO_BIG,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the training step needs") and "\n" not in err
    assert "but the device has 85.9 GB" in err and "try mesh.fsdp=true" in err


def test_check_memory_names_the_fixes_that_apply():
    cfg = load_config(["configs/tiny.yaml", "mesh.fsdp=true", "data.batch_size=16"])
    use = {"arguments": 10, "outputs": 10, "aliased": 10, "temporaries": 90, "peak": 100}
    step.check_memory(use, 100, cfg)  # fits exactly: no error
    with pytest.raises(lj.ConfigError) as e:
        step.check_memory(use, 99, cfg)
    msg = str(e.value)  # temporaries dominate: remat and a smaller micro-batch first
    assert msg.index("model.remat=module") < msg.index("data.batch_size=8 data.grad_accum=2")
    assert msg.index("data.grad_accum=2") < msg.index("more data-parallel devices")
    cfg = load_config(["configs/tiny.yaml", "model.remat=module"])
    with pytest.raises(lj.ConfigError, match=r"try mesh.fsdp=true") as e:
        step.check_memory({**use, "arguments": 95}, 99, cfg)
    assert "model.remat" not in str(e.value)


def test_trainer_checks_memory_before_its_first_step(tmp_path, monkeypatch, capsys):
    """On a known GPU the trainer compiles its step, checks it with `step.check_memory` and
    stops (exit 2, one line) before writing anything. Simulated here: the CPU backend
    reported as a GPU of 1 MB."""
    tiny_gpu = lj.hardware.Chip("TinyGPU", "TinyGPU", 1e12, 1e12, 1_000_000)
    monkeypatch.setattr(trainer.hardware, "chip_of", lambda device: tiny_gpu)
    monkeypatch.setattr(trainer.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(compilation, "compiler_options", lambda platform, program="any": {})
    run_dir = tmp_path / "runs"
    code = train_cli.main(
        [
            "configs/tiny.yaml",
            f"run_dir={run_dir}",
            "steps=2",
            "progress=none",
            "mesh.tp=2",
            "mesh.data=2",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: the training step needs") and "the device has 1.0 MB" in err
    assert "\n" not in err and "model.remat=module" in err
    assert not run_dir.exists()


@pytest.mark.parametrize("scheme", ["standard", "parallel", "ladder", "hybrid"])
def test_fsdp_gathers_at_the_module_same_loss_and_gradients(scheme):
    """Weights stored split over data (FSDP) and gathered where each module reads them give the
    loss and gradients of replicated storage."""
    config = dataclasses.replace(TINY, **SCHEMES[scheme], remat="module")
    loss0, grads0 = loss_and_grads(config, 4, 2, fsdp=False)
    loss1, grads1 = loss_and_grads(config, 4, 2, fsdp=True)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads1, grads0
    )
