"""The roofline report: a compiled H100 decode step reads each weight shard and the KV cache
once (bytes per layer within 5% of a hand-computed minimum) and every weight of a layer is read
by one matmul kernel, bf16 and int8, tp 1 and 8. Deviceless compiles of a small width, two
depths per case (the report's layer is their difference)."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

import ladder_jax as lj
from ladder_jax.analysis import compiled, hlo, perfmodel, programs, roofline
from ladder_jax.analysis.compiled import Workload
from ladder_jax.cli import predict as predict_cli
from ladder_jax.inference import generation
from ladder_jax.model import ragged
from ladder_jax.model.transformer import abstract, fuse_inputs
from ladder_jax.model.transformer import fused_input_columns as fuse_columns
from tests.helpers import cli_error, flags, predict_json

CFG = lj.ModelConfig.from_preset(
    "small",
    d_model=1024,
    n_heads=8,
    n_kv_heads=8,
    d_ff=4096,
    vocab_size=2000,
    n_layers=4,
    dtype="bfloat16",
    param_dtype="bfloat16",
    residual="standard",
)
SHAPE = dict(prompt_len=128, new_tokens=64, target="h100")


def two_layer_decode(cfg, tp, batch):
    """The deviceless H100 decode program of `cfg` cut to two layers, parsed."""
    text, _ = programs.compile_program(
        dataclasses.replace(cfg, n_layers=2),
        phase="decode",
        tp=tp,
        batch=batch,
        seq=SHAPE["prompt_len"],
        new_tokens=SHAPE["new_tokens"],
    )
    return hlo.Module(text)


CASES = [(1, None), (1, "int8"), (8, None), (8, "int8")]
CLI = dict(preset="tiny", tp=2, prompt_len=128, new_tokens=64, link="pcie", residual="standard")


def hand_minimum(cfg, tp: int, batch: int) -> int:
    """Bytes one GPU must read per layer, from the config alone: its blocks of q/k/v/o,
    gate/up/down (1 byte a weight at int8, plus a float32 scale per output channel; 2 at
    bf16), the two norms, and K and V of its kv heads over the slots the average step has
    filled (the prompt and half the new tokens)."""
    D, H, F = cfg.d_model, cfg.head_dim, cfg.d_ff
    n, k, f = cfg.n_heads // tp, max(1, cfg.n_kv_heads // tp), F // tp
    matrices = D * (n + 2 * k) * H + n * H * D + 3 * D * f
    if cfg.quantize == "int8":
        weights = matrices + 4 * ((n + 2 * k) * H + D + 2 * f + D)  # o and down: every D
    else:
        weights = 2 * matrices
    filled = SHAPE["prompt_len"] + SHAPE["new_tokens"] // 2
    assert filled < generation.cache_length(cfg, SHAPE["prompt_len"], SHAPE["new_tokens"])
    return weights + 2 * D * 2 + 2 * batch * k * filled * H * 2


@pytest.mark.parametrize("tp, quantize", CASES)
def test_decode_layer_moves_the_minimum(tp, quantize):
    cfg = dataclasses.replace(CFG, quantize=quantize)
    r = roofline.layer_report(cfg, Workload(tp, 1, **SHAPE), layers_compiled=2)
    assert r["layer_min_bytes"] == hand_minimum(cfg, tp, 1)
    assert 1.0 <= r["bytes_vs_minimum"] < 1.05, r["layer_kernels"]
    # every weight of the deeper program's layers goes into one matmul kernel, and no other
    # kernel reads it (a multiply-reduce of a weight writes a weight-sized product)
    module = two_layer_decode(cfg, tp, 1)
    mesh = programs.gpu_mesh("h100", tp)
    n_weights = len(
        jax.tree.leaves(
            nnx.state(fuse_inputs(nnx.merge(*abstract(dataclasses.replace(cfg, n_layers=2), mesh))))
        )
    )  # the program's first arguments
    alias = {
        op.name: op.name
        for op in module.entry
        if op.opcode == "parameter"
        and int(re.search(r"parameter\((\d+)\)", op.text).group(1)) < n_weights
        and op.shape.startswith(("bf16", "s8"))  # weights (int8 scales are f32)
        and len(op.dims) >= 2  # not the embedding or the head's block:
        and not {cfg.vocab_size, cfg.vocab_size // tp} & set(op.dims)
    }
    readers: dict[str, list] = {}
    for op in module.entry:
        if op.opcode == "bitcast" and op.operands and op.operands[0] in alias:
            alias[op.name] = alias[op.operands[0]]
        elif op.opcode not in ("parameter", "bitcast"):
            for name in op.operands:
                if name in alias:
                    readers.setdefault(alias[name], []).append(op)
    linears = 4  # fused q/k/v and gate/up (decode's fusion, int8 too), o, down
    assert len(readers) == 2 * linears, sorted(readers)
    for weight, ops in readers.items():
        assert [op.is_matmul() for op in ops] == [True], (weight, [o.name for o in ops])
    assert r["kernels_per_layer"] <= 24  # 20-23 here: matmuls, norms, RoPE, cache, softmax


def test_predict_rows_carry_the_report():
    """`predict` rows (the Python API and --json) hold the report, and the roofline fraction
    is the minimum step bytes at the chip's bandwidth over the predicted step."""
    rows = perfmodel.predict(
        CFG,
        tp=8,
        batch=1,
        prompt_len=128,
        new_tokens=64,
        residuals=("standard",),
        layers_compiled=2,
    )
    (r,) = rows
    chip = lj.hardware.CHIPS["h100"]
    assert r["layer_min_bytes"] == hand_minimum(CFG, 8, 1)
    head = 2 * CFG.d_model + 2 * CFG.d_model * CFG.vocab_size // 8  # final norm, head block
    assert r["step_min_bytes"] == CFG.n_layers * hand_minimum(CFG, 8, 1) + head
    assert r["roofline_fraction"] == pytest.approx(
        r["step_min_bytes"] / chip.hbm_bytes_per_s / r["decode_step_s"]
    )
    assert 0 < r["roofline_fraction"] < 1 and r["kernels_per_layer"] >= 4
    table = roofline.format_table(rows)
    assert re.search(r"\n\s+8\s+1 standard .* 1\.0\dx", table), table


def test_predict_max_len_reads_the_filled_slots_and_holds_them_all(capsys):
    """`--max-len N`: a serve row of N slots. The memory holds all N (hand count); the decode
    step reads the request's filled slots only, so its bytes grow by far less than the empty
    slots it was given (reading them would add their every byte); the minimum stays the
    request's."""
    argv = flags(**CLI, batch=2, layers_compiled=0)  # the full depth only: two programs a run
    rows = {}
    for slots in (None, 1024):
        more = [] if slots is None else flags(max_len=slots)
        (rows[slots],), _ = predict_json(capsys, argv + more)
    cfg = lj.ModelConfig.from_preset("tiny")
    per_slot = (
        cfg.n_layers * 2 * 2 * (cfg.n_kv_heads // 2) * cfg.head_dim * np.dtype(cfg.dtype).itemsize
    )  # layers, k and v, rows, kv heads per GPU
    default = generation.cache_length(cfg, 128, 64)
    assert rows[None]["slots"] is None and rows[1024]["slots"] == 1024
    assert rows[None]["kv_cache_bytes"] == per_slot * default
    assert rows[1024]["kv_cache_bytes"] == per_slot * 1024
    assert rows[1024]["layer_min_bytes"] == rows[None]["layer_min_bytes"]
    grown = rows[1024]["decode_step_hbm_bytes"] - rows[None]["decode_step_hbm_bytes"]
    assert grown < 0.25 * per_slot * (1024 - default), (grown, per_slot * (1024 - default))
    # the preset's max_seq_len (256) cannot hold 1024 slots: the programs were compiled for
    # 1024, and the row and the text output say so; the default cache fits and says nothing
    assert cfg.max_seq_len < 1024
    assert rows[1024]["max_seq_len"] == 1024
    assert rows[1024]["max_seq_len_raised_from"] == cfg.max_seq_len
    assert rows[None]["max_seq_len"] == cfg.max_seq_len
    assert rows[None]["max_seq_len_raised_from"] is None
    for slots in (None, 1024):  # the programs are compiled already: costing only
        text = [a for a in argv if a != "--json"]
        assert predict_cli.main(text + ([] if slots is None else ["--max-len", str(slots)])) == 0
        said = [
            line for line in capsys.readouterr().out.splitlines() if "max_seq_len raised" in line
        ]
        assert len(said) == (0 if slots is None else 1), said
    assert f"from the preset's {cfg.max_seq_len} to 1024" in said[0], said


def test_lj_predict_quantize_equals_the_command_line(capsys):
    """`lj.predict(..., quantize="int8")` is `predict --quantize int8`: the same rows."""
    (cli,), _ = predict_json(capsys, flags(**CLI, batch=1, quantize="int8"))
    (api,) = lj.predict(
        "tiny",
        tp=2,
        batch=1,
        prompt_len=128,
        new_tokens=64,
        links="pcie",
        residuals=["standard"],
        quantize="int8",
    )
    assert api["quantize"] == cli["quantize"] == "int8"
    assert api == pytest.approx(cli)
    (bf,) = lj.predict(
        "tiny", tp=2, batch=1, prompt_len=128, new_tokens=64, links="pcie", residuals=["standard"]
    )
    assert bf["quantize"] is None and api["weights_bytes"] < bf["weights_bytes"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--max-len", "1000"],
            "--max-len 1000: a row must hold the prompt and the new tokens, at least 1536",
        ),
        (["--max-len", "0"], "--max-len 0: a row must hold"),
        (["--max-len", "x"], "--max-len: invalid int value 'x'"),
        (
            ["--phase", "train", "--config", "configs/tiny.yaml", "--max-len", "64"],
            "--max-len 64 is for decoding",
        ),
    ],
)
def test_predict_bad_max_len_is_one_line_exit_2(capsys, args, message):
    assert message in cli_error(capsys, predict_cli.main, ["--preset", "tiny"] + args)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(quantize="int4"), "quantize='int4' is not a quantization mode"),
        (dict(slots=100, prompt_len=128, new_tokens=64), "slots=100 cannot hold the prompt"),
        (dict(slots=0), "slots=0 must be a positive integer"),
    ],
)
def test_lj_predict_bad_quantize_or_slots_raise_before_compiling(kwargs, message):
    with pytest.raises((lj.ConfigError, perfmodel.PredictError), match=re.escape(message)):
        lj.predict("tiny", tp=2, links="pcie", residuals=["standard"], **kwargs)


def test_the_decode_step_launches_as_cuda_graphs_broken_only_at_collectives():
    """XLA's command buffers: at tp 1 the step's kernels (but the sampling branch) are one
    CUDA graph; at tp 8 the graphs end only where a collective starts, one after each of a
    layer's all-reduces. With command buffers turned off there is none (the reading
    can fail)."""
    cfg = dataclasses.replace(CFG, n_layers=2)
    one = roofline.command_buffers(cfg, Workload(1, 1, **SHAPE))
    kernels = compiled.program_kernels(cfg, Workload(1, 1, **SHAPE), phase="decode").kernels
    compute = sum(k.kind == "compute" for k in kernels)
    assert one["graphs"] == 1 and one["collectives"] == 0, one
    assert one["graph_kernels"][0] >= compute - 4 and one["kernels_outside"] <= 4, (one, compute)
    eight = roofline.command_buffers(cfg, Workload(8, 1, **SHAPE))
    assert eight["kernels_outside"] <= 4, eight
    # a graph after each of the layers' two all-reduces, none without a collective before it
    assert 2 * cfg.n_layers <= eight["graphs"] <= eight["collectives"] + 1, eight
    off = roofline.command_buffers(
        cfg, Workload(1, 1, **SHAPE), options={"xla_gpu_enable_command_buffer": ""}
    )
    assert off["graphs"] == 0, off  # the graph's kernels are launched one by one instead
    assert off["kernels_outside"] == one["graph_kernels"][0] + one["kernels_outside"], off


# llama-3-70b's widths, two layers, a small vocabulary and a short cache: the weights dominate
# the minimum, as they do in the decode steps the kernel is for
WIDE = dataclasses.replace(
    CFG, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, decode_matmul="pallas"
)


@pytest.mark.parametrize("tp", [1, 8])
def test_pallas_decode_matmul_reads_each_weight_once_at_batch_16(tp):
    """`decode_matmul="pallas"`: every linear layer of the batch-16 decode step is one Triton
    `small_m_matmul` call, the only reader of its weight, with the norms and residual adds
    folded in, and the layer moves within 5% of the minimum (XLA's split-K GEMMs write
    float32 partial products that RoPE, the cache writes and the MLP's product read back:
    1.02x at tp 1, 1.10x at tp 8 at these widths). RoPE and the cache writes run inside the
    attention kernel, which reads q/k/v as the q/k/v matmul wrote them."""
    r = roofline.layer_report(WIDE, Workload(tp, 16, **SHAPE), layers_compiled=2)
    assert r["layer_min_bytes"] == hand_minimum(WIDE, tp, 16)
    assert 1.0 <= r["bytes_vs_minimum"] < 1.05, r["layer_kernels"]
    # the norms, silu(gate) * up and the residual adds run inside those calls, RoPE and the
    # cache writes inside the attention kernel: beside the four matmuls a layer keeps that
    # kernel, and at tp 8 the q/k/v split's sum (RoPE and the cache writes outside: 9 at
    # tp 1, 10 at tp 8; nothing folded: 12 and 13)
    assert r["kernels_per_layer"] <= (5 if tp == 1 else 6), r["layer_kernels"]
    module = two_layer_decode(WIDE, tp, 16)
    calls = [
        op for op in module.entry if op.opcode == "custom-call" and hlo.SMALL_M_MATMUL in op.text
    ]
    assert len(calls) == 2 * 4 and all(op.is_matmul() for op in calls)  # 4 linears a layer
    weights = {
        op.name
        for op in module.entry
        if op.opcode == "parameter"
        and op.shape.startswith("bf16")
        and len(op.dims) >= 2
        and not {WIDE.vocab_size, WIDE.vocab_size // tp} & set(op.dims)
        and WIDE.d_model in op.dims
    }
    assert len(weights) == 2 * 4
    alias = {w: w for w in weights}
    readers: dict[str, list] = {}
    for op in module.entry:  # each weight (or its bitcast) goes into its kernel only
        if op.opcode == "bitcast" and op.operands[0] in alias:
            alias[op.name] = alias[op.operands[0]]
        else:
            for name in set(op.operands) & set(alias):
                readers.setdefault(alias[name], []).append(op.name)
    assert sorted(readers) == sorted(weights)
    assert all(len(ops) == 1 for ops in readers.values()), readers
    assert {ops[0] for ops in readers.values()} == {op.name for op in calls}


# the parallel scheme at a small width with head_dim 128, on the Triton matmul: its five-way
# q/k/v/gate/up projection is one kernel whose output the attention kernel reads as it lies
PARALLEL = dataclasses.replace(CFG, residual="parallel", decode_matmul="pallas")


@pytest.mark.parametrize("tp", [1, 8])
def test_parallel_attention_reads_the_five_way_projection_in_place(tp):
    """The parallel decode layer hands its five-way projection's output whole to the ragged
    attention kernel (which reads the q/k/v columns, `ragged.attend_new`) and to the down
    projection (gate and up): no concatenate fusion or copy of q/k/v in between (splitting
    and concatenating it back costs a kernel a layer), and the layer within 5% of the
    minimum in one kernel fewer than before (7 at tp 1, 6 at tp 8)."""
    module = two_layer_decode(PARALLEL, tp, 16)
    n, kv, f = fuse_columns(PARALLEL, tp)
    width = (n + 2 * kv) * PARALLEL.head_dim + 2 * f
    projections = [
        op
        for op in module.entry
        if op.opcode == "custom-call" and hlo.SMALL_M_MATMUL in op.text and op.dims[-1] == width
    ]
    assert len(projections) == 2, [op.name for op in projections]  # one a layer
    same = {op.name: op.name for op in projections}
    readers: dict[str, list] = {}
    for op in module.entry:  # the projection (its bitcast, its output beside the stream)
        if op.opcode == "bitcast" and op.operands[0] in same:
            same[op.name] = same[op.operands[0]]
        elif op.opcode == "get-tuple-element" and op.operands[0] in same:
            if "index=0" in op.text:  # a folded prologue's call: (output, joined stream)
                same[op.name] = same[op.operands[0]]
        else:
            for name in set(op.operands) & set(same):
                readers.setdefault(same[name], []).append(op)
    for projection, ops in readers.items():
        kinds = sorted(
            "attention" if ragged.KERNEL_NAME in op.text else "down" if op.is_matmul() else op.name
            for op in ops
        )
        assert kinds == ["attention", "down"], (projection, [op.name for op in ops])
    r = roofline.layer_report(PARALLEL, Workload(tp, 16, **SHAPE), layers_compiled=2)
    assert not [k for k in r["layer_kernels"] if "concatenate" in k[0] or "copy" in k[0]]
    assert 1.0 <= r["bytes_vs_minimum"] < (1.05 if tp == 1 else 1.10), r["layer_kernels"]
    assert r["kernels_per_layer"] <= (6 if tp == 1 else 5), r["layer_kernels"]
