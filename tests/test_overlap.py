"""The overlap, measured on the compiled GPU schedule (deviceless H100 compiles, tp=8).

These compile for a CUDA target on this CPU-only machine through the CUDA PJRT plugin (a test
extra). The control (standard) shows the check can fail.
"""

import dataclasses
import functools
import importlib.util
import json

import pytest

import ladder_jax as lj
from ladder_jax.analysis import hlo, overlap, programs
from ladder_jax.cli import overlap as overlap_cli
from ladder_jax.model import paged_kernel

# tiny, with as many kv heads as ranks (no kv replication), like llama-3-8b at tp=8
BASE = dict(n_kv_heads=8)
# the server's step programs over several rows: 2 rows x a 128-token chunk at runtime offsets
# (extend), 4 rows x 1 + 4 drafted tokens (verify)
SHAPES = {"extend": dict(batch=2, seq=128), "verify": dict(batch=4, seq=128, draft=4)}


@functools.lru_cache(maxsize=None)
def _report(residual, phase, ladder_layers=None):
    config = lj.ModelConfig.from_preset(
        "tiny", residual=residual, ladder_layers=ladder_layers, **BASE
    )
    shape = SHAPES.get(phase, dict(batch=1, seq=128))
    return overlap.report(config, phase=phase, tp=8, **shape)


def _layer_ars(rep, pass_):
    return [r for r in rep["all_reduces"] if r["pass"] == pass_ and r["kind"] in ("module", "head")]


def _names(ars):
    return [(r["layer"], r["module"]) for r in ars]


@pytest.mark.parametrize("phase", ["prefill", "decode", "extend", "verify", "train"])
def test_ladder_overlaps_all_but_the_last_of_each_pass(phase):
    rep = _report("ladder", phase)
    fwd = _layer_ars(rep, "forward")
    # every module's all-reduce is found and attributed, in program order
    assert _names(fwd) == [(i, m) for i in range(4) for m in ("attn", "mlp")]
    assert [r["overlapped"] for r in fwd] == [True] * 7 + [False]
    if phase == "train":
        bwd = _layer_ars(rep, "backward")
        # head first, then the modules in reverse
        assert _names(bwd) == [(None, None)] + [
            (i, m) for i in reversed(range(4)) for m in ("mlp", "attn")
        ]
        assert all(r["overlapped"] for r in bwd[:-1]), [r["gemms_between"] for r in bwd]
        assert rep["backward"]["all_but_last_overlapped"]
    assert rep["forward"]["all_but_last_overlapped"]
    # every all-reduce of the program is attributed to a pass and a kind
    assert all(r["pass"] in ("forward", "backward") for r in rep["all_reduces"])
    assert "other" not in rep["by_kind"]


# bf16 at widths Triton can block at tp 8, the linear layers on the Pallas matmul
PALLAS_LADDER = lj.ModelConfig.from_preset(
    "tiny",
    residual="ladder",
    n_kv_heads=8,
    d_model=512,
    d_ff=1024,
    dtype="bfloat16",
    param_dtype="bfloat16",
    decode_matmul="pallas",
)


def test_ladder_decode_overlaps_with_the_pallas_matmul():
    """`decode_matmul="pallas"` (bf16, widths Triton can block at tp 8): the decode step's
    linear layers are Triton `small_m_matmul` calls, and every all-reduce but the last still
    has the next module's matmuls (those calls) between its start and done."""
    config = PALLAS_LADDER
    rep = overlap.report(config, phase="decode", tp=8, batch=1, seq=128)
    fwd = _layer_ars(rep, "forward")
    assert _names(fwd) == [(i, m) for i in range(4) for m in ("attn", "mlp")]
    assert [r["overlapped"] for r in fwd] == [True] * 7 + [False], fwd
    assert rep["forward"]["all_but_last_overlapped"]
    text, _ = programs.compile_program(config, phase="decode", tp=8, batch=1, seq=128)
    calls = [op for op in hlo.Module(text).entry if op.opcode == "custom-call" and op.is_matmul()]
    assert len(calls) == 4 * 4  # 4 linears a layer


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_ladder_decode_order_is_the_best_xla_allows(quantize):
    """XLA:GPU's latency-hiding scheduler never has two collectives over the same GPUs in
    flight together, so the ladder's decode step (the Pallas-matmul program above, as
    llama-3-8b's, bf16 and int8) runs kernels j, the done of all-reduce j - 1, the start of j: each
    module's all-reduce is done after the next module's matmuls and right before the next
    start, never after it (which is what `timeline.overlap_bound(..., one_in_flight=True)`
    assumes). A schedule queueing start j + 1 before done j, or a kernel between them,
    fails."""
    from ladder_jax.analysis.kernels import read_kernels

    config = dataclasses.replace(PALLAS_LADDER, quantize=quantize)
    text, _ = programs.compile_program(config, phase="decode", tp=8, batch=1, seq=128)
    module = hlo.Module(text)
    matmuls = {op.name for op in module.entry if op.is_matmul()}
    kernels = read_kernels(text, devices=8)
    order = [(k.kind, k.name) for k in kernels]
    starts = [k.name for k in kernels if k.kind == "start" and k.collective == "all-reduce"]
    starts = [n for n in starts if ("done", n) in order][: 4 * 2 - 1]  # the layers' async ones
    assert len(starts) == 7, order
    for this, nxt in zip(starts, starts[1:]):
        s, d = order.index(("start", this)), order.index(("done", this))
        s_next = order.index(("start", nxt))
        between = [name for kind, name in order[s + 1 : d] if kind == "compute"]
        assert any(name in matmuls for name in between), (this, between)  # hidden
        assert s_next == d + 1, (this, order[d : s_next + 1])  # one in flight, no gap


@pytest.mark.parametrize("phase", ["prefill", "decode", "extend", "verify"])
def test_standard_never_overlaps_in_inference(phase):
    rep = _report("standard", phase)
    fwd = _layer_ars(rep, "forward")
    assert len(fwd) == 8
    assert not any(r["overlapped"] for r in fwd), [r["gemms_between"] for r in fwd]


@pytest.mark.parametrize(
    "phase, tokens, kernel", [("extend", 2 * 128, False), ("verify", 4 * 5, True)]
)
def test_serving_programs_reduce_every_row_and_token(phase, tokens, kernel):
    """The extend and verify reports read the server's programs at their shapes: each module
    all-reduce carries every row's chunk or drafts (rows x tokens x d_model float32), so the
    overlap above is proven on those programs, not on a one-token step. Between them they
    hold both forms of the attention over the server's paged cache: the chunk's 128 query
    rows a kv head the XLA loop, verify's 5 the Triton kernel
    (`ladder_jax.model.paged_kernel`)."""
    for residual in ("ladder", "standard"):
        rep = _report(residual, phase)
        assert {r["bytes"] for r in _layer_ars(rep, "forward")} == {tokens * 64 * 4}
    assert rep.get("draft") == SHAPES[phase].get("draft")
    config = lj.ModelConfig.from_preset("tiny", residual="ladder", **BASE)
    shape = dict(SHAPES[phase])
    lowered = programs.lower_decoder(
        config,
        programs.gpu_mesh("h100", 8),
        phase=phase,
        batch=shape.pop("batch"),
        prompt_len=shape.pop("seq"),
        new_tokens=512,
        **shape,
    )
    assert (paged_kernel.KERNEL_NAME in lowered.as_text()) == kernel


def test_ladder_overlaps_strictly_more_than_standard_in_training():
    std, lad = _report("standard", "train"), _report("ladder", "train")
    std_n = sum(r["overlapped"] for r in _layer_ars(std, "forward") + _layer_ars(std, "backward"))
    lad_n = sum(r["overlapped"] for r in _layer_ars(lad, "forward") + _layer_ars(lad, "backward"))
    assert len(_layer_ars(std, "backward")) == len(_layer_ars(lad, "backward")) == 9
    assert lad_n > std_n
    assert not any(r["overlapped"] for r in _layer_ars(std, "forward"))


def test_hybrid_overlaps_only_into_ladder_layers():
    """Upper 2 of 4 layers ladder: a module's all-reduce overlaps iff the next module is in a
    ladder layer (layer 1's MLP overlaps layer 2's attention: the boundary rule)."""
    rep = _report("ladder", "prefill", ladder_layers=2)
    fwd = _layer_ars(rep, "forward")
    overlapped = {(r["layer"], r["module"]) for r in fwd if r["overlapped"]}
    assert overlapped == {(1, "mlp"), (2, "attn"), (2, "mlp"), (3, "attn")}


def test_cli_json_and_errors(capsys):
    assert overlap_cli.main(["--preset", "tiny", "--phase", "decode", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"total_all_reduces", "overlapped_all_reduces", "all_reduces"} <= set(out)
    assert out["total_all_reduces"] == len(out["all_reduces"]) > 0
    first = out["all_reduces"][0]
    assert {"pass", "layer", "module", "asynchronous", "gemms_between", "bytes"} <= set(first)
    assert overlap_cli.main(["--preset", "tiny", "--phase", "decode"]) == 0
    assert "all-reduces overlapping a matmul" in capsys.readouterr().out
    verify = ["--preset", "tiny", "--tp", "2", "--phase", "verify", "--draft", "2", "--seq", "16"]
    assert overlap_cli.main([*verify, "--new-tokens", "16"]) == 0
    assert "ladder verify draft=2 tp=2 on h100" in capsys.readouterr().out
    assert overlap_cli.main(["--preset", "tiny", "--tp", "3"]) == 2
    assert "n_heads=8 is not divisible by tp=3" in capsys.readouterr().err


def test_missing_plugin_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(overlap.OverlapError, match=r"pip install \"jax-cuda12-plugin==0\.10\.2\""):
        programs.gpu_mesh("h100", 8)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "batch=0 must be a positive integer"),
        (["--tp", "0"], "tp=0 must be a positive integer"),
        (["--seq", "-3"], "seq=-3 must be a positive integer"),
        (["--tp", "2", "--hosts", "0"], "hosts=0 must be a positive integer"),
        (["--tp", "4", "--hosts", "3"], "4 GPUs cannot be spread evenly over 3 hosts"),
        (["--phase", "verify", "--draft", "0"], "draft=0 must be a positive integer"),
    ],
)
def test_cli_bad_numbers_one_line_exit_2(capsys, args, message):
    assert overlap_cli.main(["--preset", "tiny", "--phase", "decode", *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and message in err[0], err


def test_dump_hlo_writes_the_program_it_reports_quietly(tmp_path):
    """`python -m ladder_jax.overlap --dump-hlo FILE` in a fresh process: the file is the
    scheduled HLO, it parses, and holds the all-reduces the report counts; stderr carries none
    of the CUDA plugin's start-up lines or XLA's deviceless CUB warning."""
    import os
    import subprocess
    import sys

    from ladder_jax.analysis import hlo

    here = tmp_path / "elsewhere"  # a relative FILE is where the command ran
    here.mkdir()
    path = here / "decode.hlo"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "LADDER_JAX_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ladder_jax.overlap",
            "--preset",
            "tiny",
            "--tp",
            "2",
            "--phase",
            "decode",
            "--seq",
            "16",
            "--new-tokens",
            "16",
            "--json",
            "--dump-hlo",
            "decode.hlo",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=here,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"scheduled HLO written to {path}" in proc.stderr, proc.stderr
    for noise in ("absl::InitializeLog", "cuda drivers", "CUB scratch"):
        assert noise not in proc.stderr, proc.stderr
    rep = json.loads(proc.stdout)
    text = path.read_text()
    module = hlo.Module(text)  # scheduled
    ars = [
        op
        for ops in module.computations.values()
        for op in ops
        if op.opcode in ("all-reduce-start", "all-reduce")
    ]
    assert len(ars) == rep["total_all_reduces"] > 0
    assert overlap.read_all_reduces(text, 64) == [
        {k: v for k, v in r.items()} for r in rep["all_reduces"]
    ]
