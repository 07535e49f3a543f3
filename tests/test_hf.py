"""Hugging Face import / export against transformers itself (PyTorch CPU, a test extra).

Small random Llamas are built here with transformers, their norm scales randomized too (so that
swapping two norms, or any two same-shaped weights, shows), and saved to temp dirs."""

import json
import os
import re

import jax
import numpy as np
import pytest
import torch  # the test extra: pip install -e ".[test]"
import transformers
from flax import nnx

import ladder_jax as lj
from ladder_jax.cli import convert
from ladder_jax.interop import hf
from ladder_jax.model import quant
from tests import reference
from tests.helpers import logits as _logits
from tests.helpers import mesh as _mesh

V = 128  # divisible by 1, 2, 4, 8
GQA_SCALED = dict(  # GQA (8 query / 2 kv heads: replicated at tp=4), llama-3 scaling, untied
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    rope_theta=500.0,
    # small original length: all three llama-3 scaling regimes occur at head_dim 8
    rope_scaling=dict(
        rope_type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
)
TIED = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
)


def _save_llama(path, *, dtype=None, max_shard_size=None, **kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        **{
            **dict(
                vocab_size=V,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=3,
                max_position_embeddings=256,
                initializer_range=0.1,
                rms_norm_eps=1e-6,
                bos_token_id=1,
                eos_token_id=2,
            ),
            **kw,
        }
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    if dtype is not None:
        model = model.to(dtype)
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **extra)
    return model


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    out = {}
    for name, kw in (("gqa_scaled", GQA_SCALED), ("tied", TIED)):
        path = tmp_path_factory.mktemp(name)
        out[name] = (str(path), _save_llama(path, **kw))
    return out


def _tokens(B=2, T=24, seed=0):
    return np.random.RandomState(seed).randint(0, V, (B, T))


def _torch_logits(tm, tokens):
    with torch.no_grad():
        return tm(torch.tensor(tokens)).logits.numpy()


def _weights(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("which", ["gqa_scaled", "tied"])
def test_logits_match_transformers(llamas, which, tp):
    path, tm = llamas[which]
    model, tokenizer = lj.load_hf(path, mesh=_mesh(tp))
    assert tokenizer is None  # no tokenizer.json here
    assert model.config.tie_embeddings == (which == "tied")
    assert (model.config.rope_scaling is not None) == (which == "gqa_scaled")
    tokens = _tokens()
    got, want = np.asarray(_logits(model, tokens)), _torch_logits(tm, tokens)
    assert np.abs(want).max() > 1.0  # not a degenerate, near-zero model
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("which", ["gqa_scaled", "tied"])
def test_load_hf_quantize_int8(llamas, which):
    """load_hf(quantize="int8") at tp=4 is the tp=1 float import quantized in memory (the same
    int8 values and scales), and stays close to transformers' float logits; a tied head stays
    float (it is the embedding table)."""
    path, tm = llamas[which]
    q, _ = lj.load_hf(path, mesh=_mesh(4), quantize="int8")
    want = quant.quantize(lj.load_hf(path, mesh=_mesh(1))[0])
    assert q.config.quantize == "int8" and q.layers[0].mlp.down.weight.dtype == np.int8
    assert (q.head is None) == (which == "tied") and q.embed.dtype == np.float32
    for a, b in zip(jax.tree.leaves(nnx.state(q)), jax.tree.leaves(nnx.state(want))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = _tokens()
    got, ref = np.asarray(_logits(q, tokens)), _torch_logits(tm, tokens)
    rel = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert 1e-4 < rel.max() < 0.1, rel.max()  # int8 (random weights, D=64: max 0.048)
    with pytest.raises(lj.ConfigError, match="save_hf .* quantized"):
        lj.save_hf(q, os.path.join(path, "never"))
    assert not os.path.exists(os.path.join(path, "never"))


def test_greedy_generation_matches_transformers(llamas):
    path, tm = llamas["gqa_scaled"]
    model, _ = lj.load_hf(path, mesh=_mesh(4))
    prompts = [[1, 17, 99, 5, 23], [1, 64, 3]]
    from ladder_jax.inference.generation import generate

    got = generate(model, prompts, max_new_tokens=20, temperature=0.0)  # no EOS stop
    tm.generation_config.eos_token_id = None  # nor there
    for prompt, ours in zip(prompts, got):
        with torch.no_grad():
            out = tm.generate(
                torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0
            )
        want = out[0, len(prompt) :].tolist()
        assert len(want) == 20 and ours == want


def test_ladder_layers_zero_reproduces_import_exactly(llamas):
    path, _ = llamas["gqa_scaled"]
    tokens = _tokens()
    standard, _ = lj.load_hf(path, mesh=_mesh(4))
    zero, _ = lj.load_hf(path, mesh=_mesh(4), residual="ladder", ladder_layers=0)
    assert zero.config.residual == "ladder" and zero.config.ladder_layers == 0
    np.testing.assert_array_equal(
        np.asarray(_logits(zero, tokens)), np.asarray(_logits(standard, tokens))
    )


def _torch_hybrid(tm, tokens, ladder, boundary_rule=True):
    """Hybrid ladder written from the spec on top of transformers' own modules. Pending
    module outputs are kept in order; before a module of a ladder layer reads the stream, all
    but the newest are added; before a standard module reads, all of them. With
    boundary_rule=False the first ladder layer wrongly sees the last standard MLP's output."""
    m = tm.model
    tokens = torch.tensor(tokens)
    T = tokens.shape[1]
    x = m.embed_tokens(tokens)
    pos = torch.arange(T)[None].expand(tokens.shape[0], T)
    rope = m.rotary_emb(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]

    def attn(layer, h):
        return layer.self_attn(
            layer.input_layernorm(h), position_embeddings=rope, attention_mask=mask
        )[0]

    def mlp(layer, h):
        return layer.mlp(layer.post_attention_layernorm(h))

    pending = []
    with torch.no_grad():
        for i, layer in enumerate(m.layers):
            for module in (attn, mlp):
                keep = 1 if i in ladder and (boundary_rule or i - 1 in ladder) else 0
                while len(pending) > keep:
                    x = x + pending.pop(0)
                pending.append(module(layer, x))
        for p in pending:
            x = x + p
        return tm.lm_head(m.norm(x)).numpy()


@pytest.mark.parametrize("tp", [1, 4])
def test_hybrid_differs_from_the_first_ladder_layer_on(llamas, tp):
    path, tm = llamas["gqa_scaled"]  # 3 layers: layer 0 standard, layers 1-2 ladder
    tokens = _tokens()
    model, _ = lj.load_hf(path, mesh=_mesh(tp), residual="ladder", ladder_layers=2)
    got = np.asarray(_logits(model, tokens))
    # Layer 0 runs exactly as transformers' decoder layer; the boundary and the ladder follow.
    want = _torch_hybrid(tm, tokens, ladder={1, 2})
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # The repository's independent reference agrees too.
    np.testing.assert_allclose(
        got,
        np.asarray(reference.forward(_weights(model), model.config, tokens)),
        atol=2e-5,
        rtol=1e-5,
    )
    # The comparison can tell: the standard model, and the boundary rule left out, differ.
    for other in (
        _torch_logits(tm, tokens),
        _torch_hybrid(tm, tokens, ladder={1, 2}, boundary_rule=False),
    ):
        assert np.abs(got - other).max() > 1e-2
    # Only-the-upper-layers check: ladder on just the last layer differs from both.
    last, _ = lj.load_hf(path, mesh=_mesh(tp), ladder_layers=1)
    np.testing.assert_allclose(
        np.asarray(_logits(last, tokens)),
        _torch_hybrid(tm, tokens, ladder={2}),
        atol=2e-5,
        rtol=1e-5,
    )


def test_round_trip_and_sharded_safetensors(llamas, tmp_path):
    path, tm = llamas["gqa_scaled"]
    tokens = _tokens()
    model, _ = lj.load_hf(path, mesh=_mesh(4), residual="ladder", ladder_layers=2)
    out = tmp_path / "export"
    lj.save_hf(model, out, max_shard_bytes=40_000)  # several files and an index
    index = json.loads((out / hf.INDEX).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    config = json.loads((out / hf.CONFIG).read_text())
    assert config["ladder_residual"] == "ladder" and config["ladder_layers"] == 2
    # back in, on another mesh: identical weights, the ladder settings honoured
    again, _ = lj.load_hf(out, mesh=_mesh(2))
    assert again.config == model.config
    jax.tree.map(np.testing.assert_array_equal, _weights(again), _weights(model))
    # ... unless overridden
    plain, _ = lj.load_hf(out, mesh=_mesh(1), residual="standard")
    assert plain.config.residual == "standard" and plain.config.ladder_layers is None
    # transformers reads the export (as a standard Llama: it ignores the ladder keys)
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(_torch_logits(back, tokens), _torch_logits(tm, tokens), atol=1e-6)


def test_sharded_bfloat16_checkpoint_from_transformers(tmp_path):
    _save_llama(tmp_path, dtype=torch.bfloat16, max_shard_size="20KB", **TIED)
    assert (tmp_path / hf.INDEX).is_file()
    # the reference: the bf16 weights in fp32 (and RoPE frequencies computed in fp32)
    tm = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model, _ = lj.load_hf(tmp_path, mesh=_mesh(2))
    tokens = _tokens()
    np.testing.assert_allclose(
        np.asarray(_logits(model, tokens)), _torch_logits(tm, tokens), atol=2e-5, rtol=1e-5
    )


def _write_st(file, tensors):
    hf._write_safetensors(str(file), tensors)


def test_safetensors_reader_returns_what_was_written_and_refuses_a_gap(tmp_path):
    """Each float dtype (bfloat16 too) and an empty tensor read back as written; a header whose
    entries are each sound but leave a gap between tensors is refused by safe_open, as one
    HFError naming the file."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
        "c": rng.standard_normal((2, 2)).astype(np.float16),
        "empty": np.zeros((0, 7), np.float64),
    }
    _write_st(tmp_path / "ok.safetensors", tensors)
    f = hf._SafetensorsFile(str(tmp_path / "ok.safetensors"))
    for name, t in tensors.items():
        got = f.read(name)
        assert got.dtype == t.dtype and got.shape == t.shape == f.shape(name), name
        np.testing.assert_array_equal(got, t)
    raw = (tmp_path / "ok.safetensors").read_bytes()
    (n,) = np.frombuffer(raw[:8], "<u8")
    header = json.loads(raw[8 : 8 + n])
    header = {"a": {**header["a"], "data_offsets": [4, 4 + 60]}}  # 4 bytes nobody owns
    h = json.dumps(header).encode()
    gap = tmp_path / "gap.safetensors"
    gap.write_bytes(len(h).to_bytes(8, "little") + h + bytes(4) + tensors["a"].tobytes())
    with pytest.raises(
        hf.HFError,
        match=r"gap\.safetensors is not a valid safetensors file "
        r"\(.*\): the download or copy is damaged",
    ):
        hf._SafetensorsFile(str(gap))


def test_bad_input_gives_clear_errors(llamas, tmp_path):
    path, _ = llamas["gqa_scaled"]
    with open(os.path.join(path, hf.CONFIG)) as f:
        hf_cfg = json.load(f)

    def variant(name, config, drop=None, swap=None):
        d = tmp_path / name
        d.mkdir()
        (d / hf.CONFIG).write_text(json.dumps(config))
        src = hf._SafetensorsFile(os.path.join(path, hf.SINGLE))
        tensors = {k: np.asarray(src.read(k)) for k in src.header if k != drop}
        if swap:
            tensors[swap] = tensors[swap][:-1]
        _write_st(d / hf.SINGLE, tensors)
        return d

    mesh = _mesh(1)
    bad = variant("gpt2", {**hf_cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(hf.HFError, match=r"model_type='gpt2' \(GPT2LMHeadModel\) is not a Llama"):
        lj.load_hf(bad, mesh=mesh)
    name = "model.layers.1.mlp.up_proj.weight"
    bad = variant("missing", hf_cfg, drop=name)
    with pytest.raises(hf.HFError, match=f"tensor '{name}' is missing"):
        lj.load_hf(bad, mesh=mesh)
    name = "model.layers.2.self_attn.k_proj.weight"
    bad = variant("shape", hf_cfg, swap=name)
    with pytest.raises(
        hf.HFError,
        match=rf"tensor '{name}' in model.safetensors has shape "
        rf"\(15, 64\), but config.json implies \(16, 64\)",
    ):
        lj.load_hf(bad, mesh=mesh)
    rope = {**hf_cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(hf.HFError, match="rope scaling type 'yarn' is not supported"):
        lj.load_hf(variant("yarn", rope), mesh=mesh)
    with pytest.raises(lj.ShardingError, match="vocab_size=127 is not divisible by tp=2"):
        lj.load_hf(variant("vocab", {**hf_cfg, "vocab_size": 127}), mesh=_mesh(2))
    with pytest.raises(hf.HFError, match="no config.json"):
        lj.load_hf(tmp_path, mesh=mesh)
    # the CLI: one line on stderr, exit code 2
    assert convert.main(["--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2


def test_tokenizer_from_tokenizer_json(llamas, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path, _ = llamas["tied"]
    d = tmp_path / "with_tok"
    d.mkdir()
    for f in os.listdir(path):
        os.symlink(os.path.join(path, f), d / f)
    words = ["<unk>", "<s>", "</s>", "the", "ladder", "overlaps", "all", "reduce"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.add_special_tokens(words[:3])  # as in a real Llama tokenizer.json
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok.save(str(d / hf.TOKENIZER))
    model, tokenizer = lj.load_hf(d, mesh=_mesh(1))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)  # from config.json
    ids = tokenizer.encode("the ladder overlaps")
    assert tokenizer.add_bos is False  # no post-processor adds BOS: transformers adds none
    assert ids == [3, 4, 5] and tokenizer.encode("the ladder overlaps", bos=True)[0] == 1
    assert tokenizer.decode(ids) == "the ladder overlaps"
    out = tmp_path / "export"
    lj.save_hf(model, out, tokenizer=tokenizer)
    assert (out / hf.TOKENIZER).read_bytes() == (d / hf.TOKENIZER).read_bytes()


def test_convert_cli_writes_a_checkpoint_init_from_reads(llamas, tmp_path):
    from ladder_jax import loading, train_config

    path, _ = llamas["tied"]
    out = tmp_path / "ckpt"
    assert (
        convert.main(
            [
                "--hf",
                path,
                "--out",
                str(out),
                "--residual",
                "ladder",
                "--ladder-layers",
                "2",
                "--tp",
                "2",
            ]
        )
        == 0
    )
    cfg = train_config.load_config([str(out / "config.yaml")])
    config = train_config.model_config(cfg)
    assert config.residual == "ladder" and config.ladder_layers == 2
    imported, _ = lj.load_hf(path, mesh=_mesh(2), ladder_layers=2)
    fresh = lj.Transformer(config, mesh=_mesh(2), rngs=nnx.Rngs(1))  # what train builds
    params = loading.load_params(str(out), nnx.state(fresh))  # what init_from= does
    got = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    jax.tree.map(np.testing.assert_array_equal, got, _weights(imported))
    # and back out to the Hugging Face layout, from the converted run
    hf_out = tmp_path / "hf"
    assert convert.main(["--checkpoint", str(out), "--out", str(hf_out), "--to-hf"]) == 0
    again, _ = lj.load_hf(hf_out, mesh=_mesh(1))
    assert again.config.ladder_layers == 2
    jax.tree.map(np.testing.assert_array_equal, _weights(again), _weights(imported))


def test_residual_ladder_alone_keeps_a_hybrid_runs_ladder_layers(llamas, tmp_path):
    """`--residual ladder` (decode, serve, convert) on a hybrid run keeps its ladder layers, as
    load_hf does for a hybrid's config.json; another scheme drops them."""
    from ladder_jax import loading
    from ladder_jax.config import scheme_overrides

    path, _ = llamas["gqa_scaled"]
    out = tmp_path / "hybrid"
    assert convert.main(["--hf", path, "--out", str(out), "--ladder-layers", "1"]) == 0
    hybrid, _ = loading.load_model(str(out), mesh=_mesh(1))
    assert hybrid.config.ladder_layer_set() == {2}
    kept, _ = loading.load_model(str(out), mesh=_mesh(1), **scheme_overrides("ladder", None))
    assert kept.config == hybrid.config
    tokens = _tokens()
    np.testing.assert_array_equal(
        np.asarray(_logits(kept, tokens)), np.asarray(_logits(hybrid, tokens))
    )  # jitted: one compile serves both (equal configs)
    whole, _ = loading.load_model(str(out), mesh=_mesh(1), **scheme_overrides("ladder", 3))
    assert whole.config.ladder_layer_set() == {0, 1, 2}
    std, _ = loading.load_model(str(out), mesh=_mesh(1), **scheme_overrides("standard", None))
    assert std.config.residual == "standard" and std.config.ladder_layers is None
    # a standard source becomes ladder throughout
    plain, _ = lj.load_hf(path, mesh=_mesh(1), **scheme_overrides("ladder", None))
    assert plain.config.ladder_layer_set() == {0, 1, 2}


def test_convert_reports_what_it_read_and_shows_progress_only_on_a_tty(llamas, tmp_path):
    import pty
    import subprocess
    import sys

    path, _ = llamas["gqa_scaled"]
    shards = tmp_path / "sharded"
    model, _ = lj.load_hf(path, mesh=_mesh(1))
    lj.save_hf(model, shards, max_shard_bytes=40_000)
    index = json.loads((shards / hf.INDEX).read_text())["weight_map"]
    total = sum(os.path.getsize(shards / f) for f in set(index.values()))
    env = {**os.environ, "COLUMNS": "120"}

    def convert_cli(out, tty):
        args = [sys.executable, "-m", "ladder_jax.convert", "--hf", str(shards), "--out", out]
        if not tty:
            p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr
            return p.stderr
        master, slave = pty.openpty()
        p = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert p.wait(timeout=300) == 0
        return b"".join(chunks).decode("utf-8", "replace")

    plain = convert_cli(str(tmp_path / "a"), tty=False)
    summary = [ln for ln in plain.splitlines() if ln.startswith("read ")]
    assert summary == [ln for ln in plain.splitlines() if ln.strip()], plain  # nothing else
    m = re.match(
        r"read (\d+) safetensors file\(s\), (\d+) tensors \(F32\), ([\d.,]+) MB", summary[0]
    )
    assert m, summary
    assert int(m.group(1)) == len(set(index.values())) > 2
    assert int(m.group(2)) == len(index)
    assert abs(float(m.group(3).replace(",", "")) * 1e6 - total) < 0.06e6 + 0.01 * total
    assert "reading" not in plain
    tty = convert_cli(str(tmp_path / "b"), tty=True)
    assert "reading" in tty and f"{len(index)}/{len(index)} tensors" in tty, tty[-2000:]


# ---------------------------------------------------------------------------------------------
# The Ladder Residual authors' checkpoints: "model_type": "llamaLadder".


class _AuthorsConfig(transformers.LlamaConfig):
    """How the authors' LlamaLadderConfig reads `ladder_layers` (restated from their rule:
    N -> the upper N layers, a list as given, null -> none)."""

    model_type = "llamaLadder"

    def __init__(self, ladder_layers=None, **kwargs):
        super().__init__(**kwargs)
        n = self.num_hidden_layers
        self.ladder_layers = (
            []
            if ladder_layers is None
            else list(range(n - ladder_layers, n))
            if isinstance(ladder_layers, int)
            else list(ladder_layers)
        )


def _authors_dir(tmp_path, llamas, name, ladder_layers):
    """The gqa_scaled weights under a config.json in the authors' exact format."""
    path, _ = llamas["gqa_scaled"]
    d = tmp_path / name
    d.mkdir()
    cfg = json.loads((open(os.path.join(path, hf.CONFIG))).read())
    cfg.update(
        model_type="llamaLadder",
        architectures=["LlamaLadderForCausalLM"],
        ladder_layers=ladder_layers,
    )
    (d / hf.CONFIG).write_text(json.dumps(cfg))
    os.symlink(os.path.join(path, hf.SINGLE), d / hf.SINGLE)
    return d


@pytest.mark.parametrize("ladder_layers, layers", [(2, {1, 2}), ([2], {2}), ([0, 2], {0, 2})])
def test_the_authors_llamaladder_config_loads_as_its_hybrid(
    llamas, tmp_path, ladder_layers, layers
):
    _, tm = llamas["gqa_scaled"]  # 3 layers
    tokens = _tokens()
    d = _authors_dir(tmp_path, llamas, "authors", ladder_layers)
    model, _ = lj.load_hf(d, mesh=_mesh(2))
    assert model.config.residual == "ladder" and model.config.ladder_layer_set() == layers
    got = np.asarray(_logits(model, tokens))
    np.testing.assert_allclose(got, _torch_hybrid(tm, tokens, ladder=layers), atol=2e-5, rtol=1e-5)
    assert np.abs(got - _torch_logits(tm, tokens)).max() > 1e-2  # not the standard model
    # residual="ladder" alone keeps the file's layers (it used to convert every layer)
    same, _ = lj.load_hf(d, mesh=_mesh(1), residual="ladder")
    assert same.config == model.config
    # an explicit ladder_layers naming the same layers is fine; other layers are an error
    agree = sorted(layers) if isinstance(ladder_layers, list) else ladder_layers
    assert lj.load_hf(d, mesh=_mesh(1), ladder_layers=agree)[0].config == model.config
    with pytest.raises(
        hf.HFError,
        match=r"config.json names its ladder layers \(ladder "
        r"layers \[.*\]\); ladder_layers=None \(every layer "
        r"ladder\) disagrees",
    ):
        lj.load_hf(d, mesh=_mesh(1), residual="ladder", ladder_layers=None)
    with pytest.raises(hf.HFError, match="disagrees: leave ladder_layers out"):
        lj.load_hf(d, mesh=_mesh(1), ladder_layers=3 if ladder_layers != 3 else 1)


def test_llamaladder_without_ladder_layers_and_bad_values(llamas, tmp_path):
    path, _ = llamas["gqa_scaled"]
    tokens = _tokens()
    standard, _ = lj.load_hf(path, mesh=_mesh(1))
    none, _ = lj.load_hf(_authors_dir(tmp_path, llamas, "none", None), mesh=_mesh(1))
    assert none.config.ladder_layer_set() == frozenset()  # their null: no ladder layers
    np.testing.assert_array_equal(
        np.asarray(_logits(none, tokens)), np.asarray(_logits(standard, tokens))
    )
    for i, bad in enumerate((5, [0, 3], [1, 1], "2", True)):
        with pytest.raises(
            hf.HFError,
            match=r"config.json: ladder_layers=.* must be N \(the "
            r"upper N of the 3 layers\)",
        ):
            lj.load_hf(_authors_dir(tmp_path, llamas, f"bad{i}", bad), mesh=_mesh(1))


def test_our_recorded_hybrid_is_not_converted_whole_by_residual_ladder(llamas, tmp_path):
    path, _ = llamas["gqa_scaled"]
    hybrid, _ = lj.load_hf(path, mesh=_mesh(1), ladder_layers=1)
    out = tmp_path / "export"
    lj.save_hf(hybrid, out)
    again, _ = lj.load_hf(out, mesh=_mesh(1), residual="ladder")
    assert again.config == hybrid.config and again.config.ladder_layer_set() == {2}
    with pytest.raises(hf.HFError, match="disagrees"):
        lj.load_hf(out, mesh=_mesh(1), ladder_layers=2)


@pytest.mark.parametrize(
    "changes, layers",
    [(dict(ladder_layers=2), [1, 2]), (dict(ladder_layers=(0, 2)), [0, 2]), (dict(), [0, 1, 2])],
)
def test_save_hf_writes_what_the_authors_llamaladder_reads(llamas, tmp_path, changes, layers):
    path, tm = llamas["gqa_scaled"]
    model, _ = lj.load_hf(path, mesh=_mesh(1), residual="ladder", **changes)
    out = tmp_path / "export"
    lj.save_hf(model, out)
    written = json.loads((out / hf.CONFIG).read_text())
    assert written["model_type"] == "llamaLadder"
    assert written["architectures"] == ["LlamaLadderForCausalLM"]
    theirs = _AuthorsConfig.from_pretrained(out)  # their config class's reading of the file
    assert theirs.ladder_layers == layers and theirs.num_hidden_layers == 3
    again, _ = lj.load_hf(out, mesh=_mesh(1))
    assert again.config == model.config
    # a standard model stays a plain LlamaForCausalLM that transformers loads as it is
    plain = tmp_path / "plain"
    lj.save_hf(lj.with_config(model, residual="standard"), plain)
    written = json.loads((plain / hf.CONFIG).read_text())
    assert written["model_type"] == "llama" and written["architectures"] == ["LlamaForCausalLM"]
    assert type(transformers.AutoConfig.from_pretrained(plain)) is transformers.LlamaConfig


def test_with_config_to_standard_drops_the_hybrids_ladder_layers(llamas):
    path, _ = llamas["gqa_scaled"]
    tokens = _tokens()
    hybrid, _ = lj.load_hf(path, mesh=_mesh(2), ladder_layers=2)
    standard = lj.with_config(hybrid, residual="standard")
    assert standard.config.residual == "standard" and standard.config.ladder_layers is None
    want, _ = lj.load_hf(path, mesh=_mesh(2))
    np.testing.assert_array_equal(
        np.asarray(_logits(standard, tokens)), np.asarray(_logits(want, tokens))
    )
    # ladder_layers given too still wins
    assert lj.with_config(standard, residual="ladder", ladder_layers=1).config.ladder_layers == 1


def test_without_tokenizer_json_decode_says_so(llamas, tmp_path, capsys):
    from ladder_jax.cli import decode
    from ladder_jax.interop.tokenizer import ByteTokenizer

    path, _ = llamas["tied"]  # vocab 128: not the byte tokenizer's
    rc = decode.main(["--checkpoint", path, "--tp", "1", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "has no tokenizer.json" in err[0] and "not byte-level" in err[0], err
    # a byte-level model exported: no tokenizer.json, and the byte tokenizer comes back
    byte = lj.Transformer(lj.ModelConfig.from_preset("tiny"), mesh=_mesh(1), rngs=nnx.Rngs(0))
    out = tmp_path / "byte"
    lj.save_hf(byte, out, tokenizer=ByteTokenizer())
    assert not (out / hf.TOKENIZER).exists()
    assert json.loads((out / hf.CONFIG).read_text())[hf.BYTE_TOKENIZER_KEY] == "byte"
    _, tokenizer = lj.load_hf(out, mesh=_mesh(1))
    assert isinstance(tokenizer, ByteTokenizer)
    (out / hf.CONFIG).write_text(
        json.dumps(
            {
                k: v
                for k, v in json.loads((out / hf.CONFIG).read_text()).items()
                if k != hf.BYTE_TOKENIZER_KEY
            }
        )
    )
    assert (
        decode.main(
            ["--checkpoint", str(out), "--tp", "1", "--max-new-tokens", "2", "--prompt", "ab"]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "has no tokenizer.json; its vocabulary (320) is byte-level" in err, err
