"""The roofline report: a compiled H100 decode step reads each weight shard and the KV cache
once (bytes per layer within 5% of a hand-computed minimum) and every weight of a layer is read
by one matmul kernel, bf16 and int8, tp 1 and 8. Deviceless compiles of a small width, two
depths per case (the report's layer is their difference)."""

import dataclasses
import re

import jax
import pytest
from flax import nnx

import ladder_jax as lj
from ladder_jax.analysis import hlo, perfmodel, programs, roofline
from ladder_jax.inference import generation
from ladder_jax.model.transformer import abstract, fuse_inputs

CFG = lj.ModelConfig.from_preset("small", d_model=1024, n_heads=8, n_kv_heads=8, d_ff=4096,
                                 vocab_size=2000, n_layers=4, dtype="bfloat16",
                                 param_dtype="bfloat16", residual="standard")
SHAPE = dict(prompt_len=128, new_tokens=64, target="h100")
CASES = [(1, None), (1, "int8"), (8, None), (8, "int8")]


def hand_minimum(cfg, tp: int, batch: int) -> int:
    """Bytes one GPU must read per layer, from the config alone: its blocks of q/k/v/o,
    gate/up/down (1 byte a weight at int8, plus a float32 scale per output channel; 2 at
    bf16), the two norms, and K and V of its kv heads over the cache's slots."""
    D, H, F = cfg.d_model, cfg.head_dim, cfg.d_ff
    n, k, f = cfg.n_heads // tp, max(1, cfg.n_kv_heads // tp), F // tp
    matrices = D * (n + 2 * k) * H + n * H * D + 3 * D * f
    if cfg.quantize == "int8":
        weights = matrices + 4 * ((n + 2 * k) * H + D + 2 * f + D)  # o and down: every D
    else:
        weights = 2 * matrices
    slots = generation.cache_length(cfg, SHAPE["prompt_len"], SHAPE["new_tokens"])
    return weights + 2 * D * 2 + 2 * batch * k * slots * H * 2


@pytest.mark.parametrize("tp, quantize", CASES)
def test_decode_layer_moves_the_minimum(tp, quantize):
    cfg = dataclasses.replace(CFG, quantize=quantize)
    r = roofline.layer_report(cfg, tp=tp, batch=1, layers_compiled=2, **SHAPE)
    assert r["layer_min_bytes"] == hand_minimum(cfg, tp, 1)
    assert 1.0 <= r["bytes_vs_minimum"] < 1.05, r["layer_kernels"]
    # every weight of the deeper program's layers goes into one matmul kernel, and no other
    # kernel reads it (a multiply-reduce of a weight writes a weight-sized product)
    text, _ = programs.compile_program(dataclasses.replace(cfg, n_layers=2), phase="decode",
                                       tp=tp, batch=1,
                                       seq=SHAPE["prompt_len"], new_tokens=SHAPE["new_tokens"])
    module = hlo.Module(text)
    mesh = programs.gpu_mesh("h100", tp)
    n_weights = len(jax.tree.leaves(nnx.state(fuse_inputs(nnx.merge(*abstract(
        dataclasses.replace(cfg, n_layers=2), mesh))))))  # the program's first arguments
    alias = {op.name: op.name for op in module.entry
             if op.opcode == "parameter" and int(re.search(r"parameter\((\d+)\)",
                                                           op.text).group(1)) < n_weights
             and op.shape.startswith(("bf16", "s8"))  # weights (int8 scales are f32)
             and len(op.dims) >= 2  # not the embedding or the head's block:
             and not {cfg.vocab_size, cfg.vocab_size // tp} & set(op.dims)}
    readers: dict[str, list] = {}
    for op in module.entry:
        if op.opcode == "bitcast" and op.operands and op.operands[0] in alias:
            alias[op.name] = alias[op.operands[0]]
        elif op.opcode not in ("parameter", "bitcast"):
            for name in op.operands:
                if name in alias:
                    readers.setdefault(alias[name], []).append(op)
    linears = 4 if quantize is None else 7  # fused q/k/v and gate/up at bf16 (decode's fusion)
    assert len(readers) == 2 * linears, sorted(readers)
    for weight, ops in readers.items():
        assert [op.is_matmul() for op in ops] == [True], (weight, [o.name for o in ops])
    assert r["kernels_per_layer"] <= 24  # 20-23 here: matmuls, norms, RoPE, cache, softmax


def test_predict_rows_carry_the_report():
    """`predict` rows (the Python API and --json) hold the report, and the roofline fraction
    is the minimum step bytes at the chip's bandwidth over the predicted step."""
    rows = perfmodel.predict(CFG, tp=8, batch=1, prompt_len=128, new_tokens=64,
                             residuals=("standard",), layers_compiled=2)
    (r,) = rows
    chip = lj.hardware.CHIPS["h100"]
    assert r["layer_min_bytes"] == hand_minimum(CFG, 8, 1)
    head = 2 * CFG.d_model + 2 * CFG.d_model * CFG.vocab_size // 8  # final norm, head block
    assert r["step_min_bytes"] == CFG.n_layers * hand_minimum(CFG, 8, 1) + head
    assert r["roofline_fraction"] == pytest.approx(
        r["step_min_bytes"] / chip.hbm_bytes_per_s / r["decode_step_s"])
    assert 0 < r["roofline_fraction"] < 1 and r["kernels_per_layer"] >= 4
    table = roofline.format_table(rows)
    assert re.search(r"\n\s+8\s+1 standard .* 1\.0\dx", table), table
