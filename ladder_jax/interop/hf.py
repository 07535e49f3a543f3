"""Hugging Face Llama checkpoints in and out: `load_hf` / `save_hf`, local files only, headers
checked before a tensor is read. The mapping, the ladder keys, the footguns:
docs/architecture.md, 'Hugging Face checkpoints'.

    model, tokenizer = ladder_jax.load_hf("Llama-3.2-1B/", mesh=lj.make_mesh(tp=8))"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import struct
import time
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ladder_jax import atomic
from ladder_jax.config import ConfigError, ModelConfig, RopeScaling, check_quantize
from ladder_jax.interop.tokenizer import ByteTokenizer, HFTokenizer
from ladder_jax.model import quant
from ladder_jax.model.transformer import Transformer, abstract

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
LADDER_TYPE = "llamaLadder"  # the Ladder Residual authors' model_type (LlamaLadderForCausalLM)
BYTE_TOKENIZER_KEY = "ladder_tokenizer"  # "byte": the model reads ByteTokenizer ids
KEEP = object()  # "take it from config.json"


class HFError(ConfigError):
    """A Hugging Face checkpoint that cannot be imported; the message names the file / tensor."""


# ---------------------------------------------------------------------------------------------
# Config.


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    params = hf.get("rope_parameters") or {}  # transformers 5.x
    legacy = hf.get("rope_scaling") or {}  # transformers 4.x
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    if type(theta) not in (int, float) or not theta > 0:
        raise HFError(
            f"config.json: rope_theta={theta!r} must be a positive number: fix it in config.json"
        )
    kind = _rope_kind(params, legacy)
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise HFError(
            f"config.json: rope scaling type {kind!r} is not supported (only the "
            f"llama-3 type 'llama3', or none)"
        )
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_len=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise HFError(f"config.json: llama3 rope scaling lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise HFError(
            f"config.json: llama3 rope scaling has a value that is not a number ({e})"
        ) from None


def _rope_kind(params: dict, legacy: dict):
    """The rope scaling type of config.json: one that is not "default" in either key wins (a
    default `rope_parameters` beside a `rope_scaling` must not hide it); two that differ are
    refused."""
    kinds = {
        k: d.get("rope_type", d.get("type", "default"))
        for k, d in (("rope_parameters", params), ("rope_scaling", legacy))
    }
    named = {k: v for k, v in kinds.items() if v not in (None, "default")}
    if len(set(map(str, named.values()))) > 1:
        raise HFError(
            f"config.json: rope_parameters says rope type {kinds['rope_parameters']!r}"
            f" and rope_scaling {kinds['rope_scaling']!r}: keep the one the model was "
            f"trained with"
        )
    return next(iter(named.values()), "default")


def _check_types(hf: dict, need: tuple) -> None:
    """Wrong JSON types fail here with the key, not later with a traceback (or silently:
    bool("false") is True)."""

    def wrong(key, what):
        return HFError(f"config.json: {key}={hf[key]!r} must be {what}: fix it in config.json")

    for key in need + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = hf.get(key)
        if (v is not None or key in need) and (type(v) is not int or v <= 0):
            raise wrong(key, "a positive integer")
    for key in ("rope_theta", "rms_norm_eps"):
        v = hf.get(key)
        if v is not None and (type(v) not in (int, float) or not v > 0):
            raise wrong(key, "a positive number")
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise wrong(key, "an object (or null)")
    if hf.get("tie_word_embeddings") is not None and type(hf["tie_word_embeddings"]) is not bool:
        raise wrong("tie_word_embeddings", "true or false")


def _layer_set(ladder_layers, n_layers: int) -> frozenset[int]:
    """The layers `ladder_layers` names: None every layer, N the upper N, else the list."""
    if ladder_layers is None:
        return frozenset(range(n_layers))
    if isinstance(ladder_layers, int):
        return frozenset(range(n_layers - ladder_layers, n_layers))
    return frozenset(ladder_layers)


def _recorded_scheme(hf: dict) -> tuple[str, Any, bool]:
    """(residual, ladder_layers, whether the file names its ladder layers) that config.json
    records: the authors' llamaLadder convention (`ladder_layers` N = the upper N layers, a
    list, or null / [] = none) or this package's "ladder_residual" / "ladder_layers" keys."""
    n = hf["num_hidden_layers"]
    if hf.get("model_type") != LADDER_TYPE:
        residual = hf.get("ladder_residual", "standard")
        ll = hf.get("ladder_layers")  # named layers are the file's, whatever residual says
        return (
            residual,
            tuple(ll) if isinstance(ll, list) else ll,
            residual == "ladder" or ll is not None,
        )
    ll = hf.get("ladder_layers")
    ll = [] if ll is None else ll
    ok = (type(ll) is int and 0 <= ll <= n) or (
        isinstance(ll, list)
        and all(type(i) is int and 0 <= i < n for i in ll)
        and len(set(ll)) == len(ll)
    )
    if not ok:
        raise HFError(
            f"config.json: ladder_layers={ll!r} must be N (the upper N of the {n} "
            f"layers) or a list of distinct layer indices in [0, {n}): fix it in "
            f"config.json"
        )
    if _layer_set(ll, n) == frozenset(range(n)):
        return "ladder", None, True  # every layer: the canonical spelling
    return (
        "ladder",
        tuple(sorted(ll)) if isinstance(ll, list) and ll else (ll if isinstance(ll, int) else 0),
        True,
    )


def _check_llama(hf: dict) -> None:
    """An HF config.json (a dict) is a Llama this package can import, or one-line HFError."""
    kind = hf.get("model_type")
    if kind not in ("llama", LADDER_TYPE):
        arch = ", ".join(hf.get("architectures") or []) or "unknown architecture"
        raise HFError(
            f"config.json: model_type={kind!r} ({arch}) is not a Llama model; only "
            f"model_type 'llama' (LlamaForCausalLM) or {LADDER_TYPE!r} "
            f"(LlamaLadderForCausalLM, the Ladder Residual authors' hybrids) can be "
            f"imported"
        )
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if hf.get(key, ok) != ok:
            raise HFError(f"config.json: {key}={hf[key]!r} is not supported (needs {ok!r})")
    if (hf.get("pretraining_tp") or 1) != 1:
        raise HFError(f"config.json: pretraining_tp={hf['pretraining_tp']} is not supported")
    need = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
    )
    missing = [k for k in need if k not in hf]
    if missing:
        raise HFError(f"config.json lacks {', '.join(missing)}")
    _check_types(hf, need)


def config_from_hf(
    hf: dict,
    *,
    residual=None,
    ladder_layers=KEEP,
    dtype="float32",
    param_dtype="float32",
    reduce_pattern=None,
    desync_tp=None,
) -> ModelConfig:
    """The `ModelConfig` of an HF LlamaForCausalLM / LlamaLadderForCausalLM config.json (a
    dict). See the module doc, "Residual scheme", for how arguments and file combine."""
    _check_llama(hf)
    n = hf["num_hidden_layers"]
    file_residual, file_layers, named = _recorded_scheme(hf)
    if isinstance(ladder_layers, list):
        ladder_layers = tuple(ladder_layers)
    if ladder_layers is not KEEP:  # an explicit ladder_layers: it must agree with the file's
        if (
            named
            and not isinstance(ladder_layers, bool)
            and isinstance(ladder_layers, (int, tuple, type(None)))
            and (_layer_set(ladder_layers, n) != _layer_set(file_layers, n))
        ):
            raise HFError(
                f"config.json names its ladder layers ({_describe(file_layers, n)}); "
                f"ladder_layers={ladder_layers!r} ({_describe(ladder_layers, n)}) disagrees: "
                f"leave ladder_layers out to load the model the file describes"
            )
        if named:
            ladder_layers = file_layers  # the same layers, in the file's spelling
        residual = residual or "ladder"
    elif residual is None:
        residual, ladder_layers = file_residual, file_layers
    elif residual == "ladder":  # the file's hybrid, never silently every layer
        ladder_layers = file_layers if named else None
    else:  # another scheme, asked for by name: the same weights, another function
        ladder_layers = None
    theta, scaling = _rope(hf)
    desync = {}
    if residual == "desync":  # the file's pattern and streams unless given
        mine = file_residual == "desync"
        pattern = reduce_pattern or (hf.get("reduce_pattern") if mine else None)
        desync = dict(
            reduce_pattern=pattern, desync_tp=desync_tp or (hf.get("desync_tp") if mine else None)
        )
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=n,
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            d_ff=hf["intermediate_size"],
            head_dim=hf.get("head_dim"),
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            residual=residual,
            ladder_layers=ladder_layers,
            dtype=dtype,
            param_dtype=param_dtype,
            **desync,
        )
    except ConfigError as e:
        raise HFError(f"config.json: {e}") from None


def _describe(ladder_layers, n_layers: int) -> str:
    layers = sorted(_layer_set(ladder_layers, n_layers))
    if not layers:
        return "no ladder layers"
    if len(layers) == n_layers:
        return "every layer ladder"
    return f"ladder layers {layers}"


def hf_config(config: ModelConfig, tokenizer=None) -> dict:
    """config.json for `config`: LlamaForCausalLM, or for a ladder / hybrid model the
    authors' LlamaLadderForCausalLM ("model_type": "llamaLadder", "ladder_layers": N or a
    list); the residual scheme also under "ladder_residual"."""
    sc = config.rope_scaling
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if sc is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            "factor": sc.factor,
            "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor,
            "original_max_position_embeddings": sc.original_max_len,
        }
    ll = config.ladder_layers
    ladder = config.residual == "ladder"
    if ladder and ll is None:
        ll = config.n_layers  # every layer: "the upper n_layers" in their convention
    out = {
        "architectures": ["LlamaLadderForCausalLM" if ladder else "LlamaForCausalLM"],
        "model_type": LADDER_TYPE if ladder else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "intermediate_size": config.d_ff,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # transformers 4.x reads rope_theta (+ rope_scaling), 5.x rope_parameters
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "dtype": str(np.dtype(config.param_dtype)),
        # the scheme (llamaLadder reads ladder_layers; ladder_residual is this package's)
        "ladder_residual": config.residual,
        "ladder_layers": list(ll) if isinstance(ll, tuple) else ll,
    }
    if config.residual == "desync":  # a reader that knows only Llama gets the standard model
        rp = config.reduce_pattern
        out["reduce_pattern"] = [list(p) for p in rp] if isinstance(rp, tuple) else rp
        out["desync_tp"] = config.desync_tp
    if sc is not None:
        out["rope_scaling"] = dict(rope)
    if tokenizer is not None:
        out["bos_token_id"], out["eos_token_id"] = tokenizer.bos_id, tokenizer.eos_id
    if isinstance(tokenizer, ByteTokenizer):
        out[BYTE_TOKENIZER_KEY] = "byte"  # no tokenizer.json exists for it
    return out


def read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG)
    if not os.path.isdir(path):
        raise HFError(f"{path!r} is not a directory (expected a Hugging Face model directory)")
    if not os.path.isfile(file):
        raise HFError(f"no config.json in {path!r}: not a Hugging Face model directory")
    try:
        with open(file, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"cannot read {file}: {e}") from None
    if not isinstance(hf, dict):
        raise HFError(
            f"{file} holds a JSON {type(hf).__name__}, not an object: a Llama "
            f'config.json is an object of settings ("model_type": "llama", ...)'
        )
    return hf


# ---------------------------------------------------------------------------------------------
# The weight table: our state path <-> HF tensor name, and the layout change both ways.


@dataclasses.dataclass(frozen=True)
class Weight:
    path: tuple  # into the model's state
    name: str  # HF tensor name
    hf_shape: tuple
    to_ours: Any  # np array (HF layout) -> np array (einsum layout)
    to_hf: Any


def weight_table(c: ModelConfig) -> list[Weight]:
    """Every weight of a model of config `c`: its path in the model, Hugging Face name and
    shape, and the maps between the two layouts."""
    D, F, V, H = c.d_model, c.d_ff, c.vocab_size, c.head_dim
    N, K = c.n_heads, c.n_kv_heads

    def same(w):
        return w

    def T(w):
        return w.T

    def proj(heads):  # (heads*H, D) <-> (D, heads, H)
        return (
            lambda w: w.reshape(heads, H, D).transpose(2, 0, 1),
            lambda w: w.transpose(1, 2, 0).reshape(heads * H, D),
        )

    out_in = (
        lambda w: w.reshape(D, N, H).transpose(1, 2, 0),  # (D, N*H) <-> (N, H, D)
        lambda w: w.transpose(2, 0, 1).reshape(D, N * H),
    )
    rows = [Weight(("embed",), "model.embed_tokens.weight", (V, D), same, same)]
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        attn, mlp = ("layers", i, "attn"), ("layers", i, "mlp")  # a `Linear`'s path: + weight
        rows += [
            Weight(
                ("layers", i, "attn_norm", "scale"), p + "input_layernorm.weight", (D,), same, same
            ),
            Weight((*attn, "q", "weight"), p + "self_attn.q_proj.weight", (N * H, D), *proj(N)),
            Weight((*attn, "k", "weight"), p + "self_attn.k_proj.weight", (K * H, D), *proj(K)),
            Weight((*attn, "v", "weight"), p + "self_attn.v_proj.weight", (K * H, D), *proj(K)),
            Weight((*attn, "o", "weight"), p + "self_attn.o_proj.weight", (D, N * H), *out_in),
            Weight(
                ("layers", i, "mlp_norm", "scale"),
                p + "post_attention_layernorm.weight",
                (D,),
                same,
                same,
            ),
            Weight((*mlp, "gate", "weight"), p + "mlp.gate_proj.weight", (F, D), T, T),
            Weight((*mlp, "up", "weight"), p + "mlp.up_proj.weight", (F, D), T, T),
            Weight((*mlp, "down", "weight"), p + "mlp.down_proj.weight", (D, F), T, T),
        ]
    rows.append(Weight(("final_norm", "scale"), "model.norm.weight", (D,), same, same))
    if not c.tie_embeddings:
        rows.append(Weight(("head", "weight"), "lm_head.weight", (V, D), T, T))
    return rows


# Tensors some checkpoints carry that the model does not need.
_IGNORED = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------------------------
# safetensors: read with the package's `safe_open`, after a header check that names the fault.

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_CODES = {v: k for k, v in _DTYPES.items()}


# Bytes per element of every safetensors dtype, to check byte ranges even of tensors we skip.
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header


class _SafetensorsFile:
    """A safetensors file read with `safetensors.safe_open`, its header checked whole first so
    that damage shows before any tensor is read, naming the tensor and byte range at fault
    (safe_open's messages do not); the rest (gaps, overlaps) safe_open refuses itself.

        f = _SafetensorsFile("model.safetensors"); f.shape(name); f.read(name)"""

    def __init__(self, file: str):
        self.file = file
        try:
            size = os.path.getsize(file)
            with open(file, "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                if n is None or n > min(size - 8, _MAX_HEADER):
                    raise HFError(
                        self._damaged(
                            f"{size} bytes, too short for a header"
                            if n is None
                            else f"its header length field says {n} bytes, the file has {size}"
                        )
                    )
                header = json.loads(f.read(n))
        except HFError:
            raise
        except OSError as e:
            raise HFError(f"{file}: cannot read it ({e.strerror or e})") from None
        except ValueError as e:  # JSON or UTF-8
            raise HFError(self._damaged(f"its header is not JSON: {e}")) from None
        if not isinstance(header, dict):
            raise HFError(
                self._damaged(f"its header is a JSON {type(header).__name__}, not an object")
            )
        header.pop("__metadata__", None)
        self.header = header
        for name, h in header.items():
            self._check(name, h, size - 8 - n)
        try:
            self._tensors = safe_open(file, framework="np")
        except SafetensorError as e:
            raise HFError(self._damaged(str(e))) from None

    def _damaged(self, why: str) -> str:
        return (
            f"{self.file} is not a valid safetensors file ({why}): the download or copy is "
            f"damaged; fetch it again"
        )

    def _check(self, name, h, data_bytes: int) -> None:
        def bad(why):
            return HFError(self._damaged(f"tensor {name!r}: {why}"))

        if not isinstance(h, dict) or any(k not in h for k in ("dtype", "shape", "data_offsets")):
            raise bad("its entry needs dtype, shape and data_offsets")
        dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
        if dtype not in _ITEMSIZE:
            raise bad(f"unknown dtype {dtype!r}")

        def sizes(xs):  # a JSON list of non-negative integers
            return isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)

        if not sizes(shape):
            raise bad(f"shape {shape!r} is not a list of sizes")
        if not sizes(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise bad(f"data_offsets {offsets!r} is not a [start, end] byte range")
        if offsets[1] > data_bytes:
            raise bad(
                f"its bytes end at {offsets[1]}, past the {data_bytes} bytes of data the "
                f"file holds (truncated?)"
            )
        if offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[dtype]:
            raise bad(
                f"{offsets[1] - offsets[0]} bytes do not hold shape {tuple(shape)} of {dtype}"
            )

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def nbytes(self, name: str) -> int:
        start, end = self.header[name]["data_offsets"]
        return end - start

    def check_dtype(self, name: str) -> None:
        if self.header[name]["dtype"] not in _DTYPES:
            raise HFError(
                f"{self.file}: tensor {name!r} has dtype {self.header[name]['dtype']}, "
                f"which cannot be imported (only {', '.join(_DTYPES)}): convert the "
                f"checkpoint's weights to a float dtype"
            )

    def read(self, name: str) -> np.ndarray:
        """The tensor (a float dtype of `_DTYPES`), read into host memory."""
        self.check_dtype(name)
        return self._tensors.get_tensor(name)


def _write_safetensors(file: str, tensors: dict[str, np.ndarray]) -> None:

    for name, t in tensors.items():
        if t.dtype not in _CODES:
            raise HFError(f"cannot write tensor {name!r} of dtype {t.dtype} to safetensors")
    tmp = file + ".tmp"
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, atomic.file_mode())  # safetensors makes it 0o600; as open() would
        os.replace(tmp, file)  # a reader never sees half a file
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, SafetensorError):  # a full disk, a read-only mount, ...
            raise atomic.as_os_error(e, file) from None
        raise


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)
        except (OSError, ValueError) as e:
            raise HFError(f"cannot read {index}: {e}") from None
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise HFError(
                f'{index} has no "weight_map" object of tensor name -> file name: '
                f"the index is damaged; fetch it again"
            )
        outside = sorted(
            {v for v in weight_map.values() if os.path.basename(v) != v or v in ("", ".", "..")}
        )
        if outside:
            raise HFError(
                f"{index} lists {outside[0]!r}, which is not a file name in {path!r}"
                f": an index names the files beside it (no directories, no '..'); "
                f"the index is damaged or not from this model, fetch it again"
            )
        absent = sorted(
            {v for v in weight_map.values() if not os.path.isfile(os.path.join(path, v))}
        )
        if absent:
            raise HFError(
                f"{index} lists {absent[0]!r}, which is not in {path!r} "
                f"({len(absent)} file(s) missing): the download is incomplete"
            )
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    if os.path.isfile(os.path.join(path, SINGLE)):
        return {
            k: os.path.join(path, SINGLE)
            for k in _SafetensorsFile(os.path.join(path, SINGLE)).header
        }
    if any(f.endswith(".bin") for f in os.listdir(path)):
        raise HFError(
            f"{path!r} has PyTorch .bin weights only: save them as safetensors first "
            f"(transformers: model.save_pretrained(dir, safe_serialization=True))"
        )
    raise HFError(f"no {SINGLE} or {INDEX} in {path!r}")


# ---------------------------------------------------------------------------------------------
# Progress of a transfer.


@dataclasses.dataclass
class Transfer:
    """What `load_hf` / `save_hf` moved, tensor by tensor; `on_tensor(transfer)` (a progress
    bar, say) is called after each one. `summary()` is the line `convert` prints."""

    on_tensor: Any = None
    kind: str = "safetensors"  # the files' format, for the summary
    files: set = dataclasses.field(default_factory=set)
    dtypes: set = dataclasses.field(default_factory=set)
    tensors: int = 0
    bytes: int = 0
    total_tensors: int = 0
    total_bytes: int = 0
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, file: str, dtype: str, nbytes: int) -> None:
        self.files.add(os.path.basename(file))
        self.dtypes.add(dtype)
        self.tensors += 1
        self.bytes += nbytes
        if self.on_tensor is not None:
            self.on_tensor(self)

    def summary(self, verb: str) -> str:
        return (
            f"{verb} {len(self.files)} {self.kind} file(s), {self.tensors} tensors "
            f"({', '.join(sorted(self.dtypes))}), {self.bytes / 1e6:,.1f} MB in "
            f"{time.perf_counter() - self.started:.1f} s"
        )


# ---------------------------------------------------------------------------------------------
# Import.


def leaf(tree, path):
    """The node of a nested dict / nnx.State at `path` (a tuple of keys)."""
    for k in path:
        tree = tree[k]
    return tree


def _checked_headers(path: str, config: ModelConfig, files: dict, table) -> dict:
    """Each weights file's header, checked against the config's weight table before any tensor
    is read: every tensor present, of its shape and dtype, and none unexpected."""
    headers = {f: _SafetensorsFile(f) for f in sorted(set(files.values()))}
    missing = [e.name for e in table if e.name not in files]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise HFError(
            f"tensor {missing[0]!r} is missing from {path!r}{more}: "
            f"{', '.join(repr(m) for m in missing[:3])}"
        )
    for e in table:
        h = headers[files[e.name]]
        if e.name not in h.header:
            raise HFError(
                f"tensor {e.name!r} is listed in {INDEX} under "
                f"{os.path.basename(files[e.name])} but is not in that file"
            )
        if h.shape(e.name) != e.hf_shape:
            raise HFError(
                f"tensor {e.name!r} in {os.path.basename(h.file)} has shape "
                f"{h.shape(e.name)}, but config.json implies {e.hf_shape}"
            )
        h.check_dtype(e.name)
    known = {e.name for e in table} | ({"lm_head.weight"} if config.tie_embeddings else set())
    extra = [n for n in files if n not in known and not n.endswith(_IGNORED)]
    if extra:
        raise HFError(
            f"tensor {extra[0]!r} in {os.path.basename(files[extra[0]])} is not a "
            f"weight of a Llama model with this config.json ({len(extra)} unexpected)"
        )
    return headers


def load_hf(
    path: str,
    *,
    mesh,
    residual: str | None = None,
    ladder_layers=KEEP,
    dtype: str = "float32",
    param_dtype: str = "float32",
    transfer: Transfer | None = None,
    quantize: str | None = None,
    reduce_pattern=None,
    desync_tp: int | None = None,
):
    """(model, tokenizer) from a local Hugging Face Llama directory; tokenizer is an
    `HFTokenizer`, or None when there is no tokenizer.json.

    residual / ladder_layers: any scheme (default: what config.json records, else standard;
    `ladder_layers` alone implies "ladder"); reduce_pattern / desync_tp: desync's (default:
    the file's, recorded beside the ladder keys; a plain Llama reader gets the standard
    model of the same weights). dtype: matmul compute dtype; param_dtype: the
    weights' dtype on the devices (float32 unless given). `transfer` counts what is read.
    `quantize="int8"`: the linear weights quantized once loaded (`ladder_jax.model.quant`; the
    float model is on the devices until then)."""
    check_quantize(quantize)
    path = os.fspath(path)
    transfer = transfer if transfer is not None else Transfer()
    hf = read_config(path)
    config = config_from_hf(
        hf,
        residual=residual,
        ladder_layers=ladder_layers,
        dtype=dtype,
        param_dtype=param_dtype,
        reduce_pattern=reduce_pattern,
        desync_tp=desync_tp,
    )
    graphdef, state = abstract(config, mesh)  # raises ShardingError if config does not fit
    files = _weight_files(path)
    table = weight_table(config)

    headers = _checked_headers(path, config, files, table)  # everything before any read

    tokenizer = HFTokenizer.from_dir(path, hf)  # a bad tokenizer.json fails before the reads
    if tokenizer is None and hf.get(BYTE_TOKENIZER_KEY) == "byte":
        tokenizer = ByteTokenizer()  # a byte-level export: there is no tokenizer.json
    transfer.total_tensors = len(table)
    transfer.total_bytes = sum(headers[files[e.name]].nbytes(e.name) for e in table)
    pure = nnx.to_pure_dict(state)
    for file, h in headers.items():  # file by file, tensor by tensor
        for e in (e for e in table if files[e.name] == file):
            var = leaf(state, e.path)
            host = np.asarray(e.to_ours(h.read(e.name)), dtype=var.dtype)  # one tensor copy
            if not np.isfinite(host).all():
                raise HFError(
                    f"{file}: tensor {e.name!r} has "
                    f"{np.count_nonzero(~np.isfinite(host))} NaN/inf values: the "
                    f"checkpoint is damaged (or was saved after training diverged)"
                )
            sharding = NamedSharding(mesh, var.spec)
            parent = leaf(pure, e.path[:-1])
            parent[e.path[-1]] = jax.make_array_from_callback(
                host.shape, sharding, lambda idx, host=host: host[idx]
            )
            del host
            transfer.add(file, h.header[e.name]["dtype"], h.nbytes(e.name))
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    return (model if quantize is None else quant.quantize(model, quantize)), tokenizer


# ---------------------------------------------------------------------------------------------
# Export.


def _to_host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))  # collective


def save_hf(
    model: Transformer,
    path: str,
    *,
    tokenizer=None,
    max_shard_bytes: int = 5 * 2**30,
    transfer: Transfer | None = None,
    overwrite: bool = False,
) -> None:
    """Writes `model` as a Hugging Face Llama directory: config.json (with the residual scheme
    under "ladder_residual" / "ladder_layers"), safetensors in the weights' dtype (several
    files and an index when they exceed `max_shard_bytes`), and the tokenizer's tokenizer.json
    if it has one (`HFTokenizer`). Host memory: one shard at a time. Multi-host: call on every
    process; process 0 writes. `transfer` counts what is written. A new directory is written
    into a temporary sibling and renamed into place once complete (`ladder_jax.atomic`): a
    failure leaves nothing. An existing directory that is not empty is refused (HFError)
    unless `overwrite=True` (its model files are then replaced, each file whole)."""
    path = os.fspath(path)
    if (
        not isinstance(max_shard_bytes, int)
        or isinstance(max_shard_bytes, bool)
        or max_shard_bytes <= 0
    ):
        raise HFError(
            f"max_shard_bytes={max_shard_bytes!r} must be a positive number of bytes "
            f"(default 5 GiB)"
        )
    if os.path.exists(path) and (not os.path.isdir(path) or (os.listdir(path) and not overwrite)):
        raise HFError(
            f"{path!r} exists and is not an empty directory: choose a new directory, "
            f"or pass overwrite=True to replace its model files"
        )
    quant.refuse(model.config, "save_hf (the Hugging Face layout holds float Llama weights)")
    transfer = transfer if transfer is not None else Transfer()
    if jax.process_index() != 0:
        _write_hf(model, None, tokenizer, max_shard_bytes, transfer)  # joins the gathers
    elif os.path.isdir(path) and os.listdir(path):
        _write_hf(model, path, tokenizer, max_shard_bytes, transfer)
    else:
        with atomic.directory(path) as tmp:
            _write_hf(model, tmp, tokenizer, max_shard_bytes, transfer)


def _write_hf(model, path: str | None, tokenizer, max_shard_bytes: int, transfer) -> None:
    """`save_hf`'s files into the directory `path` (None: this process writes nothing)."""
    config = model.config
    state = nnx.state(model)
    table = weight_table(config)
    shards, size = [[]], 0  # plan from shapes, so file names are known before writing
    for e in table:
        v = leaf(state, e.path)
        n = math.prod(v.shape) * np.dtype(v.dtype).itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    transfer.total_tensors = len(table)
    transfer.total_bytes = sum(
        math.prod(leaf(state, e.path).shape) * np.dtype(leaf(state, e.path).dtype).itemsize
        for e in table
    )
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map, total = {}, 0
    for file, entries in zip(names, shards):
        tensors = {}
        for e in entries:
            tensors[e.name] = np.ascontiguousarray(e.to_hf(_to_host(leaf(state, e.path)[...])))
            weight_map[e.name] = file
            total += tensors[e.name].nbytes
            transfer.add(
                file,
                _CODES.get(tensors[e.name].dtype, str(tensors[e.name].dtype)),
                tensors[e.name].nbytes,
            )
        if path is not None:
            _write_safetensors(os.path.join(path, file), tensors)
        del tensors
    if path is None:
        return
    if len(shards) > 1:
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    else:
        stale = os.path.join(path, INDEX)  # an index left over would shadow model.safetensors
        if os.path.exists(stale):
            os.remove(stale)
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(hf_config(config, tokenizer), f, indent=2)
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(path)
