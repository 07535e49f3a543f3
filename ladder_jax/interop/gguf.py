"""GGUF (llama.cpp) Llama checkpoints in: `load_gguf`, `gguf_tokenizer`; local files, the `gguf`
extra. Everything is checked before a weight is read (`GGUFError`, one line); the mapping and
what is refused: docs/real_model.md, 'GGUF files'.

    model, tokenizer = lj.load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", mesh=lj.make_mesh(tp=1))"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ladder_jax.config import check_quantize
from ladder_jax.interop import hf
from ladder_jax.interop.tokenizer import HFTokenizer
from ladder_jax.model import quant
from ladder_jax.model.transformer import abstract

MAGIC = b"GGUF"  # a GGUF file's first four bytes


class GGUFError(hf.HFError):
    """A GGUF file that cannot be imported; the message names the file and key / tensor."""


_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, None when it is no Llama weight."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[3] == "weight"
        and parts[2] in _BLOCK
    ):
        return f"model.layers.{int(parts[1])}.{_BLOCK[parts[2]]}.weight"
    return None


def gguf_name(name: str) -> str:
    """The GGUF name of a Hugging Face Llama tensor name (the inverse of `hf_name`)."""
    for g, h in _GLOBAL.items():
        if h == name:
            return g
    parts = name.split(".")
    sub = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{next(g for g, h in _BLOCK.items() if h == sub)}.weight"


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q / k from llama.cpp's RoPE order (a head's halves interleaved) back to the
    Hugging Face order (first half, then second half): w (heads*H, D) -> (heads*H, D)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError(
            "reading GGUF files needs the gguf package: pip install "
            '"ladder_jax[gguf]" (or pip install gguf)'
        ) from None
    return gguf


def _open(path: str):
    """The file's `GGUFReader`, or GGUFError naming what is wrong."""
    gguf = _gguf()
    if not os.path.isfile(path):
        raise GGUFError(f"{path!r} is not a file (expected a .gguf file)")
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not head.startswith(MAGIC):
        raise GGUFError(f"{path} is not a GGUF file{_not_gguf(head)}")
    try:
        reader = gguf.GGUFReader(path)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read it ({e.strerror or e})") from None
    except Exception as e:  # the reader raises ValueError / KeyError / struct errors alike
        why = (str(e).splitlines() or [""])[0] or type(e).__name__
        raise GGUFError(
            f"{path} is not a valid GGUF file: it starts like one but cannot be read, so the "
            f"download or copy is cut short or damaged (the gguf package says: {why})"
        ) from None
    check_layout(reader, path)
    return reader


def check_layout(reader, path: str) -> None:
    """Refuses a file whose tensor data is not laid out as llama.cpp requires, before any
    tensor is read: in the order the tensors are listed, each one's data starts exactly where
    the previous one's ends, rounded up to `general.alignment` (32 when absent), and the last
    ends inside the file. So none is misaligned, none overlaps another, none lies outside."""
    align = int(reader.alignment)
    start, size = int(reader.data_offset), len(reader.data)
    expected = 0
    for t in reader.tensors:
        offset = int(t.data_offset) - start
        if offset != expected:
            why = (
                f"not a multiple of the alignment, {align} bytes"
                if offset % align
                else "overlapping the data of the tensors before it"
                if offset < expected
                else "leaving a gap after the tensor before it"
            )
            raise GGUFError(
                f"{path}: tensor {t.name!r} has offset {offset}, expected {expected} ({why}): "
                f"the file is damaged; fetch or convert it again"
            )
        end = offset + int(t.n_bytes)
        if start + end > size:
            raise GGUFError(
                f"{path}: tensor {t.name!r} ends at byte {start + end} of the file, which has "
                f"{size}: the file is cut short; fetch or convert it again"
            )
        expected = -(-end // align) * align


def _not_gguf(head: bytes) -> str:
    """What follows "is not a GGUF file" for a file whose first bytes are `head`: why, and
    what to do."""
    if not head:
        return ": it is empty (0 bytes); the download or copy failed"
    text = head.lstrip().lower()
    if text.startswith(b"version https://git-lfs"):
        return " (no GGUF magic): it is a Git LFS pointer; fetch the file itself: git lfs pull"
    if text.startswith(b"<"):
        return (
            " (no GGUF magic): it looks like a web page; download the file itself, e.g. the "
            "Hugging Face Hub's /resolve/ link rather than /blob/"
        )
    return " (no GGUF magic): give a llama.cpp .gguf model file"


def _metadata(reader, path: str, keys) -> dict:
    """The values of `keys` the file has (missing ones are absent), decoded."""
    out = {}
    for key in keys:
        field = reader.fields.get(key)
        if field is None:
            continue
        try:
            out[key] = field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise GGUFError(f"{path}: metadata key {key!r} cannot be read ({e})") from None
    return out


_LLAMA = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "context_length",
    "rope.freq_base",
    "rope.dimension_count",
    "attention.layer_norm_rms_epsilon",
    "vocab_size",
    "expert_count",
    "rope.scaling.type",
)


def _hf_config(reader, path: str) -> dict:
    """The Hugging Face config dict the file's llama.* metadata describes."""
    meta = _metadata(reader, path, ["general.architecture"] + [f"llama.{k}" for k in _LLAMA])
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(
            f"{path}: general.architecture={arch!r} is not supported (only "
            f"'llama', the Llama architecture)"
        )

    def get(key, kind="int", default=None):
        full = f"llama.{key}"
        v = meta.get(full, default)
        if v is None:
            if default is None and kind == "int!":
                raise GGUFError(f"{path}: metadata key {full!r} is missing")
            return None
        ok = (
            (type(v) is int and v > 0)
            if kind.startswith("int")
            else (type(v) in (int, float) and v > 0)
        )
        if not ok:
            raise GGUFError(
                f"{path}: metadata key {full!r} is {v!r}, not a positive "
                f"{'integer' if kind.startswith('int') else 'number'}"
            )
        return v

    d, heads = get("embedding_length", "int!"), get("attention.head_count", "int!")
    kv = get("attention.head_count_kv") or heads
    head_dim = get("attention.key_length") or (d // heads)
    if get("attention.value_length") not in (None, head_dim):
        raise GGUFError(
            f"{path}: metadata key 'llama.attention.value_length' is "
            f"{meta['llama.attention.value_length']}, not the key length "
            f"{head_dim}: not supported"
        )
    if get("rope.dimension_count") not in (None, head_dim):
        raise GGUFError(
            f"{path}: metadata key 'llama.rope.dimension_count' is "
            f"{meta['llama.rope.dimension_count']}, less than the head dim "
            f"{head_dim}: partial RoPE is not supported"
        )
    if meta.get("llama.expert_count", 0) not in (0, None):
        raise GGUFError(
            f"{path}: metadata key 'llama.expert_count' is "
            f"{meta['llama.expert_count']}: mixtures of experts are not supported"
        )
    if meta.get("llama.rope.scaling.type") not in (None, "none"):
        raise GGUFError(
            f"{path}: metadata key 'llama.rope.scaling.type' is "
            f"{meta['llama.rope.scaling.type']!r}: rope scaling is not supported"
        )
    names = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError(
            f"{path}: tensor 'rope_freqs.weight' (llama-3 rope scaling factors) is not supported"
        )
    embed = names.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = int(embed.shape[-1])
    if get("vocab_size") not in (None, vocab):
        raise GGUFError(
            f"{path}: metadata key 'llama.vocab_size' is "
            f"{meta['llama.vocab_size']}, but tensor 'token_embd.weight' has "
            f"{vocab} rows"
        )
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": d,
        "num_hidden_layers": get("block_count", "int!"),
        "intermediate_size": get("feed_forward_length", "int!"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length") or 2048,
        "rope_theta": float(get("rope.freq_base", "float") or 10000.0),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", "float") or 1e-6),
        "tie_word_embeddings": "output.weight" not in names,
    }


def _supported(gguf, qtype) -> bool:
    """Whether the gguf package dequantizes `qtype` (tried on one block of zeros)."""
    if qtype == gguf.GGMLQuantizationType.F64:
        return True
    try:
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


def _dequantize(gguf, t) -> np.ndarray:
    """The tensor as float32 in its numpy shape (the reverse of GGUF's dimension order)."""
    Q = gguf.GGMLQuantizationType
    data = np.asarray(t.data)
    if t.tensor_type == Q.F64:
        w = data.view(np.float64).astype(np.float32)
    else:
        w = gguf.quants.dequantize(data, t.tensor_type)
    return np.asarray(w, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))


# ---------------------------------------------------------------------------------------------
# Tokenizer.


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character spelling: printable Latin-1 bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


# Pre-tokenizer splits by `tokenizer.ggml.pre` (others: GPT-2's own, as transformers does).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    name: _LLAMA3_SPLIT
    for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


_TOKENIZER_KEYS = (
    "model",
    "pre",
    "tokens",
    "merges",
    "token_type",
    "bos_token_id",
    "eos_token_id",
    "padding_token_id",
    "unknown_token_id",
    "add_bos_token",
)
_ID_KEYS = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id")


def _tokenizer_metadata(reader, path: str) -> dict:
    """The `tokenizer.ggml.*` values (short keys) and "chat_template", each checked."""
    meta = _metadata(
        reader, path, [f"tokenizer.ggml.{k}" for k in _TOKENIZER_KEYS] + ["tokenizer.chat_template"]
    )
    g = {k: meta.get(f"tokenizer.ggml.{k}") for k in _TOKENIZER_KEYS}
    g["chat_template"] = meta.get("tokenizer.chat_template")
    if g["model"] != "gpt2":
        raise GGUFError(
            f"{path}: metadata key 'tokenizer.ggml.model' is {g['model']!r}: only "
            f"'gpt2' (byte-level BPE) tokenizers are supported"
        )
    tokens, types = g["tokens"], g["token_type"]
    for key in ("tokens", "merges"):
        v = g[key]
        if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise GGUFError(
                f"{path}: metadata key 'tokenizer.ggml.{key}' is missing or not a list of strings"
            )
    if types is not None and not (isinstance(types, list) and len(types) == len(tokens)):
        raise GGUFError(
            f"{path}: metadata key 'tokenizer.ggml.token_type' does not list one "
            f"type per token ({len(tokens)})"
        )
    bad = next((m for m in g["merges"] if len(m.split(" ")) != 2), None)
    if bad is not None:
        raise GGUFError(
            f"{path}: metadata key 'tokenizer.ggml.merges' holds {bad!r}, not two "
            f"tokens separated by a space"
        )
    for key in _ID_KEYS:
        v = g[key]
        if v is not None and not (type(v) is int and 0 <= v < len(tokens)):
            raise GGUFError(
                f"{path}: metadata key 'tokenizer.ggml.{key}' is {v!r}, not a "
                f"token id below {len(tokens)}"
            )
    if g["add_bos_token"] is not None and type(g["add_bos_token"]) is not bool:
        raise GGUFError(
            f"{path}: metadata key 'tokenizer.ggml.add_bos_token' is "
            f"{g['add_bos_token']!r}, not true or false"
        )
    if g["chat_template"] is not None and not isinstance(g["chat_template"], str):
        raise GGUFError(f"{path}: metadata key 'tokenizer.chat_template' is not a string")
    return g


def _bpe(g: dict) -> tuple[Tokenizer, dict]:
    """The byte-level BPE of checked metadata `g`, and its vocabulary (spelled token -> id)."""
    spell = _byte_chars()
    alphabet = set(spell.values())

    def spelled(token: str) -> str:  # a token in the byte alphabet, as the merges spell it
        return token if set(token) <= alphabet else "".join(spell[b] for b in token.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(g["tokens"])}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ")) for m in g["merges"]],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _SPLITS.get(g["pre"])
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def gguf_tokenizer(path: str, reader=None) -> HFTokenizer:
    """The tokenizer in a GGUF file's metadata as an `HFTokenizer` (chat template included),
    encoding as transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=name)` does."""
    reader = reader if reader is not None else _open(path)
    g = _tokenizer_metadata(reader, path)
    tok, vocab = _bpe(g)
    tokens = g["tokens"]
    types = g["token_type"] or [0] * len(tokens)
    alphabet = set(_byte_chars().values())
    special = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    special += [
        tokens[g[k]]
        for k in _ID_KEYS
        if g[k] is not None and tokens[g[k]] in vocab and tokens[g[k]] not in special
    ]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types)
            if k == _USER_DEFINED and t in vocab
        ]
    )
    bos = g["bos_token_id"]
    if g["add_bos_token"] and bos is not None:  # a saved tokenizer.json says so too
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0",
            pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)],
        )
    return HFTokenizer(
        tokenizer=tok,
        bos_id=bos,
        eos_id=g["eos_token_id"],
        pad_id=g["padding_token_id"],
        add_bos=bool(g["add_bos_token"]),
        chat_template=g["chat_template"],
    )


# ---------------------------------------------------------------------------------------------
# Import.


def gguf_config(path: str):
    """The `ModelConfig` a GGUF file describes (standard residual), read from its metadata
    without its tensors: what a caller needs to choose a mesh first."""
    return hf.config_from_hf(_hf_config(_open(os.fspath(path)), os.fspath(path)))


def _check_tensors(reader, path: str, gguf, config) -> dict:
    """{Hugging Face name: GGUF tensor} of every weight `config` has, each checked (name,
    type, shape) before anything is read; GGUFError for a missing, unknown or wrong tensor."""
    table = hf.weight_table(config)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or (name == "lm_head.weight" and config.tie_embeddings):
            raise GGUFError(
                f"{path}: tensor {t.name!r} is not a weight of a Llama model with this metadata"
            )
        tensors[name] = t
    missing = [gguf_name(e.name) for e in table if e.name not in tensors]
    if missing:
        raise GGUFError(f"{path}: tensor {missing[0]!r} is missing ({len(missing)} missing)")
    for e in table:
        t = tensors[e.name]
        if not _supported(gguf, t.tensor_type):
            raise GGUFError(
                f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which "
                f"the gguf package cannot dequantize"
            )
        shape = tuple(int(n) for n in reversed(t.shape))
        if shape != e.hf_shape:
            raise GGUFError(
                f"{path}: tensor {t.name!r} has shape {tuple(map(int, t.shape))} "
                f"(GGUF order), but the metadata implies "
                f"{tuple(reversed(e.hf_shape))}"
            )
    return tensors


def _place(path: str, gguf, tensors: dict, config, state, mesh, transfer) -> None:
    """Reads each weight of `tensors` (dequantized, q / k rows back in Hugging Face order) into
    its sharding on `mesh`, one tensor in host memory at a time; `state` is filled in."""
    table = hf.weight_table(config)
    transfer.total_tensors = len(table)
    transfer.total_bytes = sum(int(tensors[e.name].n_bytes) for e in table)
    heads = {"self_attn.q_proj": config.n_heads, "self_attn.k_proj": config.n_kv_heads}
    pure = nnx.to_pure_dict(state)
    for e in table:
        t = tensors[e.name]
        var = hf.leaf(state, e.path)
        w = _dequantize(gguf, t)
        n = heads.get(".".join(e.name.split(".")[-3:-1]))
        if n is not None:
            w = unpermute(w, n)
        host = np.asarray(e.to_ours(w), dtype=var.dtype)
        if not np.isfinite(host).all():
            raise GGUFError(
                f"{path}: tensor {t.name!r} has "
                f"{np.count_nonzero(~np.isfinite(host))} NaN/inf values: the file "
                f"is damaged"
            )
        parent = hf.leaf(pure, e.path[:-1])
        parent[e.path[-1]] = jax.make_array_from_callback(
            host.shape, NamedSharding(mesh, var.spec), lambda idx, host=host: host[idx]
        )
        del host, w
        transfer.add(path, t.tensor_type.name, int(t.n_bytes))
    nnx.replace_by_pure_dict(state, pure)


def load_gguf(
    path: str,
    *,
    mesh,
    residual: str | None = None,
    ladder_layers=hf.KEEP,
    dtype: str = "float32",
    param_dtype: str = "float32",
    transfer: hf.Transfer | None = None,
    quantize: str | None = None,
    reduce_pattern=None,
    desync_tp: int | None = None,
):
    """(model, tokenizer) from a local GGUF Llama file; tokenizer an `HFTokenizer` from the
    file's metadata (chat template included).

    As `ladder_jax.interop.hf.load_hf`: residual / ladder_layers any scheme (default standard;
    `ladder_layers` alone implies "ladder"; reduce_pattern / desync_tp desync's), dtype the
    matmuls', param_dtype the weights' on the devices, `transfer` counts what is read,
    `quantize="int8"` quantizes once loaded."""
    check_quantize(quantize)
    path = os.fspath(path)
    gguf = _gguf()
    transfer = transfer if transfer is not None else hf.Transfer(kind="GGUF")
    reader = _open(path)
    config_dict = _hf_config(reader, path)
    try:
        config = hf.config_from_hf(
            config_dict,
            residual=residual,
            ladder_layers=ladder_layers,
            dtype=dtype,
            param_dtype=param_dtype,
            reduce_pattern=reduce_pattern,
            desync_tp=desync_tp,
        )
    except hf.HFError as e:
        raise GGUFError(f"{path}: {str(e).removeprefix('config.json: ')}") from None
    graphdef, state = abstract(config, mesh)  # raises ShardingError if config does not fit
    tensors = _check_tensors(reader, path, gguf, config)
    tokenizer = gguf_tokenizer(path, reader)  # a bad tokenizer fails before the reads
    if tokenizer.vocab_size > config.vocab_size:
        raise GGUFError(
            f"{path}: metadata key 'tokenizer.ggml.tokens' lists "
            f"{tokenizer.vocab_size} tokens, more than the {config.vocab_size} "
            f"rows of 'token_embd.weight'"
        )
    _place(path, gguf, tensors, config, state, mesh, transfer)
    model = nnx.merge(graphdef, state)
    return (model if quantize is None else quant.quantize(model, quantize)), tokenizer
