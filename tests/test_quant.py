"""Weight-only int8 (`ladder_jax.model.quant`): accuracy against the float model on a model
trained here, sharding invariance, storage, the int8 GPU program (bytes and overlap), errors.

One small model is trained once for the module (tiny preset, 2 layers, on the embedded
corpus); every comparison is against an independent reference: the float model, the tp=1
run, the model quantized in memory.
"""

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ladder_jax as lj
from ladder_jax import train_config
from ladder_jax.analysis import hlo, overlap, programs
from ladder_jax.analysis.kernels import read_kernels
from ladder_jax.cli import convert as convert_cli
from ladder_jax.cli import decode as decode_cli
from ladder_jax.config import ConfigError
from ladder_jax.inference import generation
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.model import quant
from ladder_jax.model.transformer import abstract, fuse_inputs
from ladder_jax.train import data, trainer
from tests.helpers import SCHEMES, TINY, logits, mesh

SEQ, EVAL_FRACTION = 64, 0.05
TRAIN = [
    "model.n_layers=2",
    f"data.seq_len={SEQ}",
    "data.batch_size=16",
    "steps=150",
    "eval_every=0",
    "ckpt_every=0",
    "eval_batches=2",
    "progress=none",
    "log_every=1000",
    "optim.warmup_steps=10",
    "optim.peak_lr=3e-3",
    "mesh.tp=1",
    "mesh.data=1",
    f"data.eval_fraction={EVAL_FRACTION}",
]

# Per position: ||int8 logits - float logits|| / ||float logits|| over the vocabulary.
REL_ERROR_PER_POSITION = 0.01  # measured: max 0.0021, mean 0.0011 over 512 positions


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant")
    out = trainer.run(train_config.load_config(TRAIN + [f"run_dir={path}", "name=float"]))
    assert out["eval_loss"] < 3.0  # predictions are not trivial: well below ln(320) = 5.8
    return str(path / "float")


@pytest.fixture(scope="module")
def held_out():
    """(B, SEQ + 1) held-out records of the embedded corpus: the run's own eval split."""
    tokens = data.load_tokens(None, ByteTokenizer())
    _, records = data.split(tokens, SEQ, EVAL_FRACTION)
    return np.stack([records[i] for i in range(8)])  # 8 x 64 = 512 positions


def _loss(logits_btv, targets_bt):
    logp = jax.nn.log_softmax(np.asarray(logits_btv, np.float64), axis=-1)
    return -float(np.mean(np.take_along_axis(logp, targets_bt[..., None], -1)))


def test_int8_tracks_float_on_a_trained_model(run, held_out):
    model, _ = lj.load(run, tp=1)
    qmodel = quant.quantize(model)
    tokens, targets = held_out[:, :-1], held_out[:, 1:]
    f = np.asarray(logits(model, tokens))
    q = np.asarray(logits(qmodel, tokens))
    rel = np.linalg.norm(q - f, axis=-1) / np.linalg.norm(f, axis=-1)
    assert rel.shape == (8, SEQ) and rel.max() < REL_ERROR_PER_POSITION, rel.max()
    agree = np.mean(q.argmax(-1) == f.argmax(-1))
    assert agree >= 0.95, agree
    loss_f, loss_q = _loss(f, targets), _loss(q, targets)
    print(
        f"int8 vs float on {rel.size} held-out positions: relative logit error max "
        f"{rel.max():.4f} mean {rel.mean():.4f}; greedy agreement {agree:.4f}; held-out loss "
        f"{loss_f:.4f} float, {loss_q:.4f} int8 ({100 * (loss_q / loss_f - 1):+.3f}%)"
    )
    assert abs(loss_q - loss_f) <= 0.01 * loss_f, (loss_f, loss_q)
    # the check can fail: int8 is not the float model, and a cruder rounding is caught
    assert rel.mean() > 1e-4
    crude = nnx.merge(*nnx.split(qmodel))
    for layer in crude.layers:
        layer.mlp.down.scale[...] = layer.mlp.down.scale[...] * 1.5
    worse = np.asarray(logits(crude, tokens))
    assert (
        np.linalg.norm(worse - f, axis=-1) / np.linalg.norm(f, axis=-1)
    ).max() > REL_ERROR_PER_POSITION


def test_quantized_weights_are_int8_with_scales_sharded_like_them():
    model = lj.Transformer(TINY, mesh=mesh(4), rngs=nnx.Rngs(0))
    qmodel = quant.quantize(model)
    attn, mlp = qmodel.layers[0].attn, qmodel.layers[0].mlp
    assert attn.q.weight.dtype == jnp.int8 and attn.q.scale.shape == (1, 8, 8)
    assert attn.o.scale.shape == (1, 1, 64) and mlp.down.scale.shape == (1, 64)
    m = qmodel.mesh

    def laid_out(x, *spec):
        return x.sharding.is_equivalent_to(NamedSharding(m, P(*spec)), x.ndim)

    assert laid_out(attn.q.weight, None, "tp", None) and laid_out(attn.q.scale, None, "tp", None)
    assert laid_out(attn.o.weight, "tp", None, None) and laid_out(attn.o.scale)  # output D
    assert laid_out(mlp.gate.scale, None, "tp") and laid_out(mlp.down.scale)
    assert laid_out(qmodel.head.scale, None, "tp")
    assert qmodel.head.weight.dtype == jnp.int8 and qmodel.embed.dtype == jnp.float32
    # independent reference: numpy's per-output-channel rounding of the float weight
    w = np.asarray(model.layers[0].attn.o.weight[...])
    scale = np.abs(w).max(axis=(0, 1), keepdims=True) / 127
    np.testing.assert_array_equal(
        np.asarray(attn.o.weight[...]), np.round(w / scale).astype(np.int8)
    )
    np.testing.assert_allclose(np.asarray(attn.o.scale[...]), scale, rtol=1e-6)
    # a quantized preset draws the same weights and quantizes them
    direct = lj.Transformer(
        dataclasses.replace(TINY, quantize="int8"), mesh=mesh(4), rngs=nnx.Rngs(0)
    )
    np.testing.assert_array_equal(
        np.asarray(direct.layers[1].mlp.up.weight[...]),
        np.asarray(qmodel.layers[1].mlp.up.weight[...]),
    )


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_int8_tp4_equals_tp1(scheme):
    """Quantizing is mesh-independent (same int8 values and scales at tp 1 and 4) and the
    sharded int8 forward equals the unsharded one, kv heads replicated (K=4 < tp=8) too."""
    tokens = np.random.default_rng(0).integers(0, 320, (2, 24))
    one = quant.quantize(
        lj.Transformer(dataclasses.replace(TINY, **SCHEMES[scheme]), mesh=mesh(1), rngs=nnx.Rngs(1))
    )
    ref = np.asarray(logits(one, tokens))
    for tp in (4, 8) if scheme == "ladder" else (4,):
        many = quant.quantize(
            lj.Transformer(
                dataclasses.replace(one.config, quantize=None), mesh=mesh(tp), rngs=nnx.Rngs(1)
            )
        )
        for a, b in zip(jax.tree.leaves(nnx.state(one)), jax.tree.leaves(nnx.state(many))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(logits(many, tokens)), ref, rtol=2e-5, atol=2e-5)


def test_store_quantized_then_load_and_generate(run, tmp_path):
    out = str(tmp_path / "int8")
    assert convert_cli.main(["--checkpoint", run, "--out", out, "--quantize", "int8"]) == 0
    stored, tok = lj.load(out, mesh=mesh(2))
    assert stored.config.quantize == "int8" and stored.layers[0].attn.q.weight.dtype == jnp.int8
    with open(os.path.join(out, "config.yaml")) as f:
        assert "quantize: int8" in f.read()
    in_memory = quant.quantize(lj.load(run, tp=1)[0])
    for a, b in zip(jax.tree.leaves(nnx.state(in_memory)), jax.tree.leaves(nnx.state(stored))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # stored, not re-rounded
    # lj.load(quantize=) of the stored model leaves it as it is; of the float run, quantizes
    again, _ = lj.load(out, mesh=mesh(1), quantize="int8")
    loaded_float, _ = lj.load(run, mesh=mesh(4), quantize="int8")
    prompts = ["LOVE, n.", "The "]
    want = lj.generate(in_memory, prompts, tokenizer=tok, max_new_tokens=24)
    assert lj.generate(stored, prompts, tokenizer=tok, max_new_tokens=24) == want
    assert lj.generate(again, prompts, tokenizer=tok, max_new_tokens=24) == want
    assert lj.generate(loaded_float, prompts, tokenizer=tok, max_new_tokens=24) == want
    assert len(want[0]) > 0
    # the CPU decoder reads the dequantized copy: its greedy tokens are those of the int8
    # forward (no KV cache), token by token
    ids = ByteTokenizer().encode("LOVE, n.")
    seq = list(ids)
    for _ in range(12):
        seq.append(int(np.asarray(logits(stored, np.array([seq])))[0, -1].argmax()))
    assert generation.generate(stored, [ids], max_new_tokens=12)[0] == seq[len(ids) :]


def test_float_only_paths_refuse_quantized_weights(run, tmp_path, capsys):
    out = str(tmp_path / "int8")
    assert convert_cli.main(["--checkpoint", run, "--out", out, "--quantize", "int8"]) == 0
    capsys.readouterr()
    # training from it
    cfg = train_config.load_config(
        TRAIN + [f"run_dir={tmp_path}", "name=ft", f"init_from={out}", "steps=1"]
    )
    with pytest.raises(ConfigError, match=r"is quantized .* decoding only"):
        trainer.run(cfg)
    with pytest.raises(ConfigError, match=r"model.quantize=int8: training runs on float"):
        trainer.run(
            train_config.load_config(
                TRAIN + [f"run_dir={tmp_path}", "name=q", "model.quantize=int8"]
            )
        )
    assert not os.path.exists(tmp_path / "q")
    # exporting it to the Hugging Face layout: one line, nothing written
    hf_out = str(tmp_path / "hf")
    assert convert_cli.main(["--checkpoint", out, "--out", hf_out, "--to-hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is quantized (int8): --to-hf writes float" in err
    assert not os.path.exists(hf_out)
    assert (
        convert_cli.main(["--checkpoint", run, "--out", hf_out, "--to-hf", "--quantize", "int8"])
        == 2
    )
    assert "the Hugging Face layout holds float" in capsys.readouterr().err
    assert not os.path.exists(hf_out)
    with pytest.raises(ConfigError, match="save_hf .* quantized"):
        lj.save_hf(lj.load(out, tp=1)[0], hf_out)
    with pytest.raises(ConfigError, match="quantized already"):
        quant.quantize(lj.load(out, tp=1)[0])


@pytest.mark.parametrize(
    "argv",
    [
        ["--quantize", "int4"],
        ["--quantize", "int4", "--benchmark"],
    ],
)
def test_unknown_mode_is_one_line_naming_the_modes(argv, capsys):
    assert decode_cli.main(argv + ["--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --quantize int4 is not a quantization mode: choose int8 (or none, "
        "for float weights)\n"
    )
    with pytest.raises(ConfigError, match="quantize='int4' is not a quantization mode"):
        lj.ModelConfig.from_preset("tiny", quantize="int4")
    with pytest.raises(ConfigError, match="int4"):
        lj.load("nowhere", tp=1, quantize="int4")


def test_decode_cli_int8(capsys):
    assert (
        decode_cli.main(
            ["--quantize", "int8", "--tp", "2", "--max-new-tokens", "4", "--temperature", "0"]
        )
        == 0
    )
    assert "weights int8" in capsys.readouterr().err  # the model summary, on stderr
    assert (
        decode_cli.main(
            [
                "--quantize",
                "int8",
                "--tp",
                "2",
                "--benchmark",
                "--json",
                "--batch",
                "4",
                "--prompt-len",
                "8",
                "--max-new-tokens",
                "3",
            ]
        )
        == 0
    )
    assert '"quantize": "int8"' in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# The int8 GPU program (deviceless H100 compiles).

# Wide enough that weights dominate what a decode step reads (and that XLA reads each int8
# weight straight into its matmul kernel at one token per row); 2 layers, tp=2.
WIDE = dict(
    vocab_size=4096,
    d_model=2048,
    n_layers=2,
    n_heads=16,
    n_kv_heads=8,
    d_ff=8192,
    max_seq_len=256,
    dtype="bfloat16",
    param_dtype="bfloat16",
)


@functools.lru_cache(maxsize=None)
def _decode_hlo(quantize):
    config = lj.ModelConfig.from_preset("tiny", **WIDE)
    text, _ = programs.compile_program(
        config, phase="decode", tp=2, batch=1, seq=16, new_tokens=16, quantize=quantize
    )
    return dataclasses.replace(config, quantize=quantize), text


def _weight_bytes(config, text):
    """Bytes of the ENTRY parameters that are weights, per GPU (jit's arguments are the
    state's leaves first, in order)."""
    n = len(
        jax.tree.leaves(
            nnx.state(fuse_inputs(nnx.merge(*abstract(config, programs.gpu_mesh("h100", 2)))))
        )
    )  # decoding's fused model
    params = {
        int(op.text.split("parameter(")[1].split(")")[0]): op
        for op in hlo.computations(text)["ENTRY"]
        if op.opcode == "parameter"
    }
    return sum(hlo.nbytes(params[i].shape) for i in range(n))


def test_int8_decode_program_reads_int8_weights():
    cfg_b, bf16 = _decode_hlo(None)
    cfg_q, int8 = _decode_hlo("int8")
    wb, wq = _weight_bytes(cfg_b, bf16), _weight_bytes(cfg_q, int8)
    # the linear weights halve; the embedding table stays bf16 (a lookup reads B rows)
    assert 0.5 < wq / wb < 0.6, (wb, wq)
    assert "s8[2048,8192]" in int8 and "s8[2048,8192]" not in bf16  # a rank's fused gate/up

    # every int8 weight is read by its matmul's own kernel (no kernel converts or rescales a
    # weight first: the scale comes after the contraction)
    entry = hlo.computations(int8)["ENTRY"]
    users = {}
    for op in entry:
        for name in re.findall(r"%([\w.\-]+)", op.arguments.split(")")[0]):
            users.setdefault(name, []).append(op)

    def readers(name):
        return [
            r
            for u in users.get(name, ())
            for r in (readers(u.name) if u.opcode == "bitcast" else [u])
        ]

    s8 = [op.name for op in entry if op.opcode == "parameter" and op.shape.startswith("s8[")]
    assert len(s8) == 2 * 4 + 1  # q/k/v, o, gate/up, down a layer (fused) and the head
    for name in s8:
        assert readers(name) and all(r.is_matmul() for r in readers(name)), (
            name,
            [(r.name, r.op_name) for r in readers(name)],
        )

    def read(text):
        return sum(k.nbytes for k in read_kernels(text) if k.kind == "compute")

    print(
        f"decode step per GPU: weights {wb / 1e6:.1f} MB bf16, {wq / 1e6:.1f} MB int8; "
        f"kernel bytes {read(bf16) / 1e6:.1f} MB bf16, {read(int8) / 1e6:.1f} MB int8"
    )
    assert read(int8) < 0.6 * read(bf16), (read(int8), read(bf16))


def test_ladder_overlap_holds_on_the_int8_decode_program():
    config = lj.ModelConfig.from_preset("tiny", residual="ladder", n_kv_heads=8, quantize="int8")
    rep = overlap.report(config, phase="decode", tp=8, batch=1, seq=128)
    assert "s8[" in str(rep["preset_config"]) or rep["preset_config"]["quantize"] == "int8"
    fwd = [a for a in rep["all_reduces"] if a["kind"] in ("module", "head")]
    assert [(a["layer"], a["module"]) for a in fwd] == [
        (i, m) for i in range(4) for m in ("attn", "mlp")
    ]
    assert [a["overlapped"] for a in fwd] == [True] * 7 + [False]
    std = overlap.report(
        dataclasses.replace(config, residual="standard"), phase="decode", tp=8, batch=1, seq=128
    )  # the control
    assert not any(a["overlapped"] for a in std["all_reduces"] if a["kind"] == "module")


@pytest.mark.parametrize("tp", [1, 8])
def test_int8_fused_projections_equal_the_separate_ones(tp):
    """Decoding (on GPU meshes) fuses an int8 model's q/k/v and gate/up: values and per-channel
    scales alike, each rank's own kv head where kv heads are replicated (tp 8 > 4 heads). The
    fused model's forward equals the separate projections' (a scale dropped or taken from the
    wrong head would not)."""
    model = quant.quantize(lj.Transformer(TINY, mesh=mesh(tp), rngs=nnx.Rngs(3)))
    fused = fuse_inputs(model)
    qkv = fused.layers[0].attn.qkv
    assert fused.layers[0].attn.q is None and qkv.weight.dtype == jnp.int8
    assert qkv.scale is not None and qkv.scale.dtype == jnp.float32
    tokens = np.random.default_rng(0).integers(0, 320, (2, 24))
    np.testing.assert_allclose(
        np.asarray(logits(fused, tokens)), np.asarray(logits(model, tokens)), rtol=2e-5, atol=2e-5
    )
