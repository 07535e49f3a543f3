"""Every configuration in one place: `ModelConfig` and its presets, a training run's `TrainConfig`
(the schema of `python -m ladder_jax.train`), their checks, and `UsageError` (the base of every
user error; `ConfigError` for configs), which every command-line tool turns into one line and
exit code 2.

    config = ModelConfig.from_preset("llama-3-8b", residual="ladder", ladder_layers=16)
    cfg = load_config(["configs/tiny.yaml", "model.residual=ladder"])   # a TrainConfig

YAML files merge left to right, then `key=value` overrides (OmegaConf structured configs); an
error names the key (and the closest valid one) or the file and line. The model section is
derived from `ModelConfig`'s own fields; every field carries its help text (`train --help`).
Nothing here imports jax's backends or the rest of the package.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
from typing import Any, Optional

import jax.numpy as jnp
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors


class UsageError(ValueError):
    """Bad input from the user (a config, a flag, a file, data, a request); the message names
    it and the fix. The command-line tools print it as one line and exit 2."""


class ConfigError(UsageError):
    """A configuration that cannot be built or run; the message names the key / field and the
    fix."""


# ---------------------------------------------------------------------------------------------
# The model.

# The residual schemes: RESIDUALS, what "all" compares (benchmarks, predict), and desync,
# whose function depends on desync_tp; SCHEMES, every value of `ModelConfig.residual`.
RESIDUALS = ("standard", "parallel", "ladder", "upper_bound")
SCHEMES = (*RESIDUALS, "desync")
# Desync's named reduce patterns (`ModelConfig.desync_syncs`): which modules all-reduce.
REDUCE_PATTERNS = ("every_layer", "every_2_layers", "final_only")

# Activation rematerialization for training. "none": the backward reads what the forward
# stored (every module's intermediate activations). "module": each module (attention, MLP;
# a parallel layer's pair) stores only its input and recomputes its internals (its norm
# included) in the backward: about one extra forward of compute for activation memory that
# no longer grows with d_ff or the number of heads (one stream-sized array per module). The
# ladder's backward still overlaps its all-reduces (the recomputation is more matmul work
# beside them). "matmuls": each module keeps its input and the outputs of its weight matmuls
# and recomputes the rest (norm, rotary, attention's scores and softmax, SwiGLU's activation):
# little recomputation, and the activations that grow with the sequence (T x T scores) dropped.
REMAT = ("none", "module", "matmuls")

# Weight-only quantization for decoding (`ladder_jax.model.quant`): None keeps float weights.
QUANTIZE = ("int8",)

# The matmul of a linear layer over a few rows on GPUs (`ladder_jax.model.matvec`): XLA's, or
# the Pallas (Triton) kernel that reads each weight once.
DECODE_MATMULS = ("xla", "pallas")


def check_quantize(mode, what: str = "quantize") -> None:
    """Refuses, naming the modes, a quantization mode that does not exist (None: float)."""
    if mode is not None and mode not in QUANTIZE:
        given = f"{what} {mode}" if what.startswith("-") else f"{what}={mode!r}"
        raise ConfigError(
            f"{given} is not a quantization mode: choose "
            f"{', '.join(QUANTIZE)} (or none, for float weights)"
        )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """llama-3 style RoPE frequency scaling (long wavelengths slowed by `factor`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


def _doc(text: str, default=dataclasses.MISSING, **kw):
    """A dataclass field with its help text (`train --help` prints it per key)."""
    return dataclasses.field(default=default, metadata={"help": text}, **kw)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = _doc(
        "tokens in the vocabulary (tp must divide it: the LM head is split over it)"
    )
    d_model: int = _doc("width of the residual stream")
    n_layers: int = _doc("layers, each an attention and an MLP module")
    n_heads: int = _doc("query heads")
    n_kv_heads: int = _doc("key / value heads (grouped-query attention; must divide n_heads)")
    d_ff: int = _doc("hidden width of the SwiGLU MLP")
    head_dim: int | None = _doc("width of one head (null: d_model / n_heads)", None)
    max_seq_len: int = _doc("longest sequence (RoPE table, KV cache)", 2048)
    rope_theta: float = _doc("RoPE base frequency", 10000.0)
    rope_scaling: RopeScaling | None = _doc(
        "llama-3 RoPE scaling {factor, low_freq_factor, high_freq_factor, original_max_len} "
        "(null: none)",
        None,
    )
    norm_eps: float = _doc("RMSNorm epsilon", 1e-5)
    tie_embeddings: bool = _doc("the LM head is the embedding, transposed", False)
    residual: str = _doc(
        "residual wiring: standard | parallel | ladder | upper_bound (a speed "
        "ceiling for benchmarks, not a valid model) | desync (per-rank streams that sync "
        "where reduce_pattern says)",
        "standard",
    )
    ladder_layers: int | tuple[int, ...] | None = _doc(
        "ladder only: N (the upper N layers) or a list of layer indices (null: every layer)", None
    )
    reduce_pattern: str | tuple[tuple[bool, bool], ...] | None = _doc(
        "desync only: every_layer | every_2_layers | final_only, or per layer a pair "
        "[attention syncs, mlp syncs] (null: every_layer)",
        None,
    )
    desync_tp: int | None = _doc(
        "desync only: the residual streams the model carries, the tp size it is defined for "
        "(null: the mesh's tp, fixed when the model is built)",
        None,
    )
    dtype: str = _doc("matmul compute dtype, e.g. bfloat16", "float32")
    param_dtype: str = _doc("dtype of the weights (and of the optimizer state)", "float32")
    remat: str = _doc(
        "training memory: none | module (each module keeps only its input and "
        "recomputes the rest in the backward) | matmuls (it keeps its input and its "
        "weight matmuls' outputs, recomputing norms, softmax and activations); same function",
        "none",
    )
    quantize: str | None = _doc(
        "decoding only: int8 weight-only linear weights (null: float; ladder_jax.model.quant)", None
    )
    decode_matmul: str = _doc(
        "GPU meshes only: xla | pallas, the matmul of linear layers over at most 16 rows "
        "(decode steps): pallas is a Triton kernel that reads each weight once "
        "(ladder_jax.model.matvec); CPU meshes always run XLA's",
        "xla",
    )

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "d_ff",
            "max_seq_len",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                    f"set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if not _is_int(self.head_dim) or self.head_dim <= 0:
            raise ConfigError(
                f"head_dim={self.head_dim!r} must be a positive even integer "
                f"(or unset: d_model // n_heads)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        for name, usual in (("rope_theta", "10000 or 500000"), ("norm_eps", "1e-5 or 1e-6")):
            v = getattr(self, name)  # 0 or negative: every step is NaN
            if not _is_number(v) or not (v > 0 and math.isfinite(v)):
                raise ConfigError(
                    f"{name}={v!r} must be a positive finite number (usually {usual})"
                )
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"tie_embeddings={self.tie_embeddings!r} must be true or false")
        object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        if self.residual not in SCHEMES:
            close = difflib.get_close_matches(str(self.residual), SCHEMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown residual scheme {self.residual!r}{hint}: choose one of "
                f"{', '.join(SCHEMES)}"
            )
        if self.remat not in REMAT:
            raise ConfigError(f"remat={self.remat!r}: choose one of {', '.join(REMAT)}")
        check_quantize(self.quantize)
        if self.decode_matmul not in DECODE_MATMULS:
            raise ConfigError(
                f"decode_matmul={self.decode_matmul!r}: choose one of {', '.join(DECODE_MATMULS)}"
            )
        for name in ("dtype", "param_dtype"):
            v = getattr(self, name)
            try:
                dt = jnp.dtype(v)
            except TypeError:
                dt = None
            if dt is None or not jnp.issubdtype(dt, jnp.floating):
                why = "is not a dtype name" if dt is None else "is not a floating-point dtype"
                raise ConfigError(f"{name}={v!r} {why}: choose float32, bfloat16 or float16")
        self._check_desync()
        ll = self.ladder_layers
        if ll is None:
            return
        if self.residual != "ladder":
            raise ConfigError(
                f"ladder_layers={ll!r} is set but residual={self.residual!r}: ladder_layers "
                f"only applies to residual='ladder'"
            )
        if isinstance(ll, bool):
            raise ConfigError(f"ladder_layers={ll!r} must be an int or a list of layer indices")
        if isinstance(ll, int):
            if not 0 <= ll <= self.n_layers:
                raise ConfigError(
                    f"ladder_layers={ll} must be between 0 and n_layers={self.n_layers}"
                )
            return
        idx = tuple(ll)
        bad = [i for i in idx if not isinstance(i, int) or not 0 <= i < self.n_layers]
        if bad or len(set(idx)) != len(idx):
            raise ConfigError(
                f"ladder_layers={list(idx)} must be distinct layer indices in [0, {self.n_layers})"
            )
        object.__setattr__(self, "ladder_layers", tuple(sorted(idx)))

    def _check_desync(self) -> None:
        """reduce_pattern and desync_tp: set only with residual="desync", and valid."""
        for name in ("reduce_pattern", "desync_tp"):
            if getattr(self, name) is not None and self.residual != "desync":
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is set but residual={self.residual!r}: "
                    f"{name} only applies to residual='desync'"
                )
        if self.residual != "desync":
            return
        if self.quantize is not None:
            raise ConfigError(f"quantize={self.quantize!r}: desync decodes float weights only")
        rp = self.reduce_pattern
        if isinstance(rp, list):
            rp = tuple(tuple(p) if isinstance(p, list) else p for p in rp)
            object.__setattr__(self, "reduce_pattern", rp)
        if isinstance(rp, tuple):
            _check_pattern(rp, self.n_layers)
        elif rp is not None and rp not in REDUCE_PATTERNS:
            close = difflib.get_close_matches(str(rp), REDUCE_PATTERNS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown reduce_pattern {rp!r}{hint}: choose one of "
                f"{', '.join(REDUCE_PATTERNS)}, or a list of [attention, mlp] sync pairs"
            )
        if self.desync_tp is not None:
            check_desync_tp(self, self.desync_tp)

    def desync_syncs(self) -> tuple[tuple[bool, bool], ...]:
        """Per layer (attention syncs, mlp syncs): the resolved reduce_pattern of a desync
        model (every_layer when unset); the last layer's MLP always syncs."""
        rp, L = self.reduce_pattern, self.n_layers
        if isinstance(rp, tuple):
            return rp
        if rp in (None, "every_layer"):
            return tuple((False, True) for _ in range(L))
        if rp == "every_2_layers":
            return tuple((False, i % 2 == 1 or i == L - 1) for i in range(L))
        return tuple((False, i == L - 1) for i in range(L))  # final_only

    # -- presets ---------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named preset (see `PRESETS`), with any field overridden by keyword."""
        if name not in PRESETS:
            close = difflib.get_close_matches(name, PRESETS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown preset {name!r}{hint}: choose one of {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in overrides:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"unknown ModelConfig field {key!r}{hint}")
        return cls(**{**PRESETS[name], **overrides})

    # -- derived ---------------------------------------------------------------------------

    def ladder_layer_set(self) -> frozenset[int]:
        """Indices of the layers with ladder wiring (empty unless residual == 'ladder')."""
        if self.residual != "ladder":
            return frozenset()
        ll = self.ladder_layers
        if ll is None:
            return frozenset(range(self.n_layers))
        if isinstance(ll, int):
            return frozenset(range(self.n_layers - ll, self.n_layers))
        return frozenset(ll)

    def num_params(self) -> int:
        D, F, V, H = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        attn = D * self.n_heads * H * 2 + D * self.n_kv_heads * H * 2
        layer = attn + 3 * D * F + 2 * D
        embed = V * D * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + embed + D


def _check_pattern(rp: tuple, n_layers: int) -> None:
    """An explicit reduce_pattern: n_layers pairs of bools, the last layer's MLP syncing."""
    ok = all(
        isinstance(p, tuple) and len(p) == 2 and all(isinstance(b, bool) for b in p) for p in rp
    )
    if not ok or len(rp) != n_layers:
        raise ConfigError(
            f"reduce_pattern: give {n_layers} [attention, mlp] pairs of true/false (one per "
            f"layer), got {[list(p) if isinstance(p, tuple) else p for p in rp]!r}"
        )
    if not rp[-1][1]:
        raise ConfigError(
            "reduce_pattern: the last layer's MLP must sync (its streams become the logits); "
            "use residual=upper_bound for no sync at all"
        )


def check_desync_tp(config, desync_tp) -> None:
    """desync_tp: a positive int that splits the query heads, the MLP hidden units and the kv
    heads (or is a multiple of their count) into that many streams."""
    T = desync_tp
    if not _is_int(T) or T <= 0:
        raise ConfigError(f"desync_tp={T!r} must be a positive integer (or null: the mesh's tp)")
    K = config.n_kv_heads
    if config.n_heads % T or config.d_ff % T or (K % T and T % K):
        raise ConfigError(
            f"desync_tp={T} cannot split n_heads={config.n_heads}, d_ff={config.d_ff} and "
            f"n_kv_heads={K} into {T} streams: choose a divisor of the heads and of d_ff"
        )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rope_scaling(v) -> RopeScaling | None:
    """`rope_scaling` as a checked RopeScaling (from a mapping of its fields), or None."""
    if v is None:
        return None
    fields = [f.name for f in dataclasses.fields(RopeScaling)]
    if isinstance(v, RopeScaling):
        v = dataclasses.asdict(v)
    if not isinstance(v, dict):
        raise ConfigError(
            f"rope_scaling={v!r} must be null or a mapping of {', '.join(fields)}"
            f" (llama-3's: factor 8, low_freq_factor 1, high_freq_factor 4, "
            f"original_max_len 8192)"
        )
    unknown = [k for k in v if k not in fields]
    if unknown:
        raise ConfigError(
            f"rope_scaling has no field {unknown[0]!r}: its fields are {', '.join(fields)}"
        )
    r = RopeScaling(**v)
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        x = getattr(r, name)
        if not _is_number(x) or not (x > 0 and math.isfinite(x)):
            raise ConfigError(f"rope_scaling.{name}={x!r} must be a positive finite number")
    if not r.high_freq_factor > r.low_freq_factor:
        raise ConfigError(
            f"rope_scaling.high_freq_factor={r.high_freq_factor} must be larger "
            f"than low_freq_factor={r.low_freq_factor}"
        )
    if not _is_int(r.original_max_len) or r.original_max_len <= 0:
        raise ConfigError(
            f"rope_scaling.original_max_len={r.original_max_len!r} must be a positive integer"
        )
    return r


PRESETS: dict[str, dict] = {  # ModelConfig fields; head_dim is derived unless given
    # CPU-sized, byte-level vocabulary (256 bytes + specials, padded to a multiple of 16).
    "tiny": dict(
        vocab_size=320, d_model=64, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=128, max_seq_len=256
    ),
    "small": dict(
        vocab_size=320, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=768, max_seq_len=512
    ),
    # The paper's inference-benchmark shapes (ICML 2025, arXiv 2501.06589).
    "1b": dict(
        vocab_size=49152,
        d_model=1536,
        n_layers=40,
        n_heads=24,
        n_kv_heads=24,
        d_ff=4096,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "3b": dict(
        vocab_size=49152,
        d_model=2304,
        n_layers=40,
        n_heads=32,
        n_kv_heads=32,
        d_ff=9216,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "llama-3-8b": dict(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "34b": dict(
        vocab_size=32000,
        d_model=8192,
        n_layers=48,
        n_heads=64,
        n_kv_heads=8,
        d_ff=22016,
        max_seq_len=16384,
        rope_theta=1000000.0,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "llama-3-70b": dict(
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        d_ff=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    # Llama 2 (Touvron et al. 2023, arXiv 2307.09288; the released config.json files): the
    # shapes of the A100 tables of gpt-fast-style benchmarks. 70B uses GQA (8 kv heads).
    "llama-2-7b": dict(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        d_ff=11008,
        max_seq_len=4096,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "llama-2-70b": dict(
        vocab_size=32000,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        d_ff=28672,
        max_seq_len=4096,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "llama-3.1-405b": dict(
        vocab_size=128256,
        d_model=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=16,
        d_ff=53248,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0),
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
}


def parse_ladder_layers(text: str | None):
    """The command-line form of `ladder_layers`: "N" (the upper N layers) or "i,j,..."."""
    if text is None:
        return None
    try:
        if "," not in text:
            return int(text)
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(
            f"--ladder-layers {text!r}: give N (the upper N layers) or a comma "
            f"list of layer indices, e.g. 0,2,4"
        ) from None


def parse_reduce_pattern(text: str | None):
    """The command-line form of `reduce_pattern`: a preset name, or per layer two letters of
    y/n (attention, mlp) separated by commas, e.g. "ny,ny,ny,ny" for every_layer."""
    if text is None or text in REDUCE_PATTERNS:
        return text
    pairs = [p.strip().lower() for p in text.split(",")]
    if not all(len(p) == 2 and set(p) <= {"y", "n"} for p in pairs):
        raise ConfigError(
            f"--reduce-pattern {text!r}: give {', '.join(REDUCE_PATTERNS)}, or per layer two "
            f"letters y/n (attention, mlp), comma separated, e.g. ny,ny"
        )
    return tuple((p[0] == "y", p[1] == "y") for p in pairs)


def scheme_overrides(
    residual: str | None, ladder_layers, reduce_pattern=None, desync_tp=None
) -> dict:
    """ModelConfig overrides for the command-line flags --residual / --ladder-layers /
    --reduce-pattern / --desync-tp: a scheme's own keys alone imply it (ladder_layers: ladder;
    reduce_pattern, desync_tp: desync); another scheme alone drops them; a scheme alone keeps
    the model's own, so a hybrid checkpoint stays the hybrid it is (as `load_hf` and
    `with_config` do) and any other model becomes that scheme throughout."""
    desync = (("reduce_pattern", reduce_pattern), ("desync_tp", desync_tp))
    desync = {k: v for k, v in desync if v is not None}
    if desync:
        if residual not in (None, "desync") or ladder_layers is not None:
            flags = ", ".join("--" + k.replace("_", "-") for k in desync)
            raise ConfigError(f"{flags} applies to --residual desync, not {residual!r}")
        return {"residual": "desync", "ladder_layers": None, **desync}
    if ladder_layers is not None:
        if residual not in (None, "ladder"):
            raise ConfigError(f"--ladder-layers applies to --residual ladder, not {residual!r}")
        return {"residual": "ladder", "ladder_layers": ladder_layers}
    if residual is None:
        return {}
    return (
        {"residual": residual}
        if residual == "ladder"
        else {"residual": residual, "ladder_layers": None}
    )


# ---------------------------------------------------------------------------------------------
# A training run.


class Choice(enum.StrEnum):
    """A config key's choices, checked by OmegaConf; the members are their own strings (equal
    to, printed and serialized as the plain value)."""

    def __repr__(self):
        return repr(self.value)


Residual = Choice("Residual", {r: r for r in SCHEMES})
Remat = Choice("Remat", {r: r for r in REMAT})
Progress = Choice("Progress", {p: p for p in ("auto", "bar", "lines", "none")})


@dataclasses.dataclass
class OptimizerConfig:
    """The optimizer's settings, with the paper's defaults; also the `optim` section of a
    training config (mutable, as OmegaConf merges YAML into it)."""

    peak_lr: float = _doc("learning rate after warmup", 3e-4)
    warmup_steps: int = _doc("linear warmup from 0", 100)
    end_lr_fraction: float = _doc("cosine decay ends at peak_lr x this", 0.1)
    b1: float = _doc("AdamW beta 1", 0.9)
    b2: float = _doc("AdamW beta 2", 0.95)
    eps: float = _doc("AdamW epsilon", 1e-10)
    weight_decay: float = _doc("AdamW decoupled weight decay", 0.1)
    grad_clip: float = _doc("clip the global gradient norm to this", 1.0)


# The model section of a training config is ModelConfig's fields, each null (= the preset's
# value) unless set, plus the preset's name. Two keep a training default of their own:
# residual (every preset is standard) and param_dtype (training keeps float32 master weights
# even for the bfloat16 presets).
_SECTION_DEFAULTS = {"residual": Residual.standard, "param_dtype": "float32"}
_CHOICES = {"residual": Residual, "remat": Remat}
_PLAIN = {"int": int, "float": float, "bool": bool, "str": str}


def _section_field(f: dataclasses.Field):
    base = f.type.replace(" | None", "") if isinstance(f.type, str) else f.type
    typ = _CHOICES.get(f.name) or _PLAIN.get(base, Any)
    return (f.name, Optional[typ], _doc(f.metadata["help"], _SECTION_DEFAULTS.get(f.name)))


ModelSection = dataclasses.make_dataclass(
    "ModelSection",
    [
        (
            "preset",
            str,
            _doc(f"the ModelConfig preset the other keys change: {', '.join(PRESETS)}", "tiny"),
        )
    ]
    + [_section_field(f) for f in dataclasses.fields(ModelConfig)],
)
ModelSection.__module__ = __name__
ModelSection.__doc__ = """A `ModelConfig` preset with fields overridden (null = the preset's
value): the model section of a training config, derived from ModelConfig's fields."""


@dataclasses.dataclass
class DataSection:
    path: Optional[str] = _doc(
        "a text file, glob, directory or .npy token arrays (null: the embedded corpus)", None
    )
    tokenizer: str = _doc("byte, or a local tokenizer.json", "byte")
    seq_len: int = _doc("tokens per sequence", 256)
    batch_size: int = _doc("sequences per micro-batch, global (all processes)", 16)
    grad_accum: int = _doc("micro-batches per step", 1)
    eval_fraction: float = _doc("held-out share of the records", 0.05)
    seed: int = _doc("shuffle seed", 0)


@dataclasses.dataclass
class MeshSection:
    tp: int = _doc("tensor-parallel size", 1)
    data: Optional[int] = _doc(
        "data-parallel size (null: the devices left over; on a CPU host, one fake device "
        "per core over tp while a copy of the training state is under 1 GiB, else 1)",
        None,
    )
    fsdp: bool = _doc("also shard weights and optimizer state over `data`", False)
    cpu_devices: Optional[int] = _doc(
        "CPU host: fake devices to make (null: what the mesh needs)", None
    )


@dataclasses.dataclass
class DistSection:
    coordinator_address: Optional[str] = _doc(
        "host:port of process 0 (or JAX_COORDINATOR_ADDRESS)", None
    )
    num_processes: Optional[int] = _doc("processes in all (or JAX_NUM_PROCESSES)", None)
    process_id: Optional[int] = _doc("this process, 0..N-1 (or JAX_PROCESS_ID)", None)


@dataclasses.dataclass
class DistillSection:
    teacher: Optional[str] = _doc(
        "distill from this frozen model (run, convert output, HF "
        "directory, GGUF file; null: plain fine-tuning)",
        None,
    )
    weight: float = _doc(
        "share of the KL to the teacher in the loss (the rest: cross-entropy on the data)", 1.0
    )
    temperature: float = _doc("softmax temperature of both distributions in the KL", 1.0)


def _section(cls, text: str):
    return dataclasses.field(default_factory=cls, metadata={"help": text})


@dataclasses.dataclass
class TrainConfig:
    name: str = _doc("the run's directory is <run_dir>/<name>", "run")
    run_dir: str = _doc("where runs live", "runs")
    steps: int = _doc("optimizer steps in all (a resumed run continues to this)", 1000)
    seed: int = _doc("weight init seed", 0)
    log_every: int = _doc("a progress line every this many steps", 10)
    eval_every: int = _doc("held-out loss every this many steps (0: only at the end)", 200)
    eval_batches: int = _doc("held-out batches per evaluation", 8)
    loss_chunk: Optional[int] = _doc(
        "cross-entropy over this many positions of each sequence at a time, "
        "so that the float32 logits and their gradient are never whole "
        "(0: all at once; null: 64 when a step's float32 logits would exceed 64 MiB, "
        "as with large vocabularies, else 0; same loss up to rounding)",
        None,
    )
    ckpt_every: int = _doc(
        "a checkpoint every this many steps (0: only at the end and on SIGTERM)", 200
    )
    keep: int = _doc("checkpoints kept", 3)
    async_ckpt: bool = _doc("write checkpoints while training goes on", True)
    max_bad_steps: int = _doc("non-finite steps in a row before the run stops (exit 3)", 5)
    accept_changes: bool = _doc(
        "resume although model / data / optimizer keys changed (recorded in changes.jsonl)", False
    )
    init_from: Optional[str] = _doc(
        "weights only, from a run or checkpoint directory (for fine-tuning)", None
    )
    progress: Progress = _doc(
        "auto (a bar on a terminal, else lines) | bar | lines | none", Progress.auto
    )
    tensorboard: Optional[bool] = _doc(
        "event files in <run>/tensorboard (null: if tensorboardX is installed)", None
    )
    benchmark: bool = _doc("time every residual scheme's step instead of training", False)
    bench_steps: int = _doc("benchmark: timed rounds", 5)
    peak_tflops: Optional[float] = _doc("per device, for MFU (null: known GPUs only)", None)
    model: ModelSection = _section(
        ModelSection, "the model: a preset, any field changed (null: the preset's value)"
    )
    data: DataSection = _section(DataSection, "the data (and held-out split)")
    optim: OptimizerConfig = _section(
        OptimizerConfig, "AdamW, warmup + cosine (the paper's settings)"
    )
    mesh: MeshSection = _section(MeshSection, "devices: a data x tp mesh")
    dist: DistSection = _section(
        DistSection,
        "several processes (jax.distributed); unset "
        "under SLURM or with the JAX_* environment variables",
    )
    distill: DistillSection = _section(
        DistillSection, "distillation from a frozen teacher (ladder_jax.train.distill)"
    )


def _keys(node=TrainConfig, prefix="") -> list[str]:
    out = []
    for f in dataclasses.fields(node):
        t = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if t is not None and dataclasses.is_dataclass(t):
            out += _keys(t, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _closest(key: str) -> str:
    keys = _keys()
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close:  # a key put in the wrong section: compare the last part only
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1] or [
            k
            for k in keys
            if k.rsplit(".", 1)[-1]
            in difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in keys], n=1)
        ][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_config(args: list[str], overrides: dict | None = None) -> TrainConfig:
    """YAML files and `key=value` overrides, merged in order onto the schema's defaults, then
    `overrides` (a nested dict of Python values, as `ladder_jax.fit` passes them)."""
    cfg = OmegaConf.structured(TrainConfig)
    a = None  # what is being merged, for the messages
    try:
        args = list(args) + ([OmegaConf.create(overrides)] if overrides else [])
        for a in args:
            if isinstance(a, DictConfig):
                cfg = OmegaConf.merge(cfg, a)
            elif "=" in a:
                key, value = a.split("=", 1)
                if not key or key.startswith("-"):
                    raise ConfigError(f"bad override {a!r}: write key=value, e.g. steps=100")
                cfg = OmegaConf.merge(cfg, _parse_override(a, key, value))
            else:
                cfg = OmegaConf.merge(cfg, _find_tokenizer(_read_yaml(a), a))
        return OmegaConf.to_object(cfg)
    except oc_errors.ConfigKeyError as e:
        key = e.full_key or str(e.key)
        where = f"{a}: " if isinstance(a, str) and "=" not in a else ""
        raise ConfigError(f"{where}unknown config key {key!r}{_closest(key)}") from None
    except oc_errors.ValidationError as e:
        section = a.split("=", 1)[0] if isinstance(a, str) and "=" in a else None
        if not e.full_key and section in {f.name for f in dataclasses.fields(TrainConfig)}:
            raise ConfigError(
                f"config key {section!r} is a section, not a value: set its keys "
                f"(e.g. {_keys()[[k.split('.')[0] for k in _keys()].index(section)]}"
                f"=...), got {a!r}"
            ) from None
        field = _field(e.full_key)
        choices = _choices_of(field)
        if choices is not None:
            close = difflib.get_close_matches(str(e.value), choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{e.full_key}={e.value!r}{hint}: choose one of {', '.join(choices)}"
            ) from None
        want = _type_name(getattr(field, "type", None))
        raise ConfigError(f"config key {e.full_key!r} must be {want}, got {e.value!r}") from None
    except oc_errors.OmegaConfBaseException as e:
        raise ConfigError(f"bad config: {str(e).splitlines()[0]}") from None
    except Exception as e:  # YAML syntax errors and the like
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"cannot read the config: {str(e).splitlines()[0]}") from None


def _parse_override(arg: str, key: str, value: str):
    """`key=value` as OmegaConf reads it (the value is YAML); a value YAML cannot read (a
    pasted `...` placeholder is YAML's document end) is a ConfigError naming key and value."""
    try:
        return OmegaConf.from_dotlist([arg])
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        hint = (
            " (a placeholder: put the real value there)"
            if value.strip() in ("...", "…")
            else "; quote it if it is text, e.g. key='a: b'"
        )
        raise ConfigError(
            f"override {key}={value!r}: the value is not valid YAML ({problem}){hint}"
        ) from None


def _read_yaml(path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found (overrides are key=value)")
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path!r}: {e}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(
            f"{path}: a config file must be a mapping of keys (model:, data:, "
            f"...), not a {type(node).__name__}"
        )
    return node


def _find_tokenizer(node: DictConfig, file: str) -> DictConfig:
    """`node` (config file `file`) with its data.tokenizer found wherever the file is: a
    relative path against the file's directory, else (as before) the working directory; when
    the path named is not there, the tokenizer.json beside the file (a `convert` output or a
    run directory moved or copied elsewhere). A config.yaml with checkpoints/ beside it whose
    tokenizer is nowhere is a ConfigError; another file keeps its path as written (a training
    config may name a tokenizer made later)."""
    data = node.get("data")
    name = data.get("tokenizer") if isinstance(data, DictConfig) else None
    if not isinstance(name, str) or name == "byte" or "${" in name:
        return node
    here = os.path.dirname(os.path.abspath(file))
    tried = [name] if os.path.isabs(name) else [os.path.join(here, name), name]
    found = next(
        (t for t in [*tried, os.path.join(here, "tokenizer.json")] if os.path.isfile(t)), None
    )
    if found is not None:
        data.tokenizer = found
    elif os.path.isdir(os.path.join(here, "checkpoints")):
        raise ConfigError(
            f"{file}: data.tokenizer={name!r} is not there, nor is a tokenizer.json beside "
            f"the file: copy the model's tokenizer.json into {here}"
        )
    return node


def _field(full_key: str):
    node = TrainConfig
    field = None
    for part in (full_key or "").split("."):
        field = {f.name: f for f in dataclasses.fields(node)}.get(part) if node else None
        if field is None:
            return None
        node = (
            field.default_factory
            if dataclasses.is_dataclass(getattr(field, "default_factory", None))
            else None
        )
    return field


def _type_name(typ) -> str:
    """ "int", "int or null" (Optional[int]), ... for an error message."""
    if isinstance(typ, str):  # an annotation of this module
        optional = typ.startswith("Optional[")
        name = typ[len("Optional[") : -1] if optional else typ
    else:
        args = [a for a in getattr(typ, "__args__", ()) if a is not type(None)]
        optional = len(args) == 1
        name = getattr(args[0] if optional else typ, "__name__", None) or str(typ)
    return f"{name} or null" if optional else name.replace("typing.", "")


def _choices_of(field) -> list[str] | None:
    """The choices of an enum-typed schema field (None for any other field)."""
    typ = getattr(field, "type", None)
    if isinstance(typ, str):  # an annotation of this module, e.g. "Progress"
        typ = globals().get(typ)
    for t in (typ, *getattr(typ, "__args__", ())):  # Optional[X] too
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return [m.value for m in t]
    return None


def help_rows(node=TrainConfig, prefix="") -> list[tuple[str, Any, str, bool]]:
    """(dotted key, default, help, is a section) of every key of the training schema, in
    order; a section's row comes before its keys."""
    rows = []
    for f in dataclasses.fields(node):
        if dataclasses.is_dataclass(f.default_factory):
            rows.append((prefix + f.name, None, f.metadata.get("help", ""), True))
            rows += help_rows(f.default_factory, f"{prefix}{f.name}.")
        else:
            rows.append((prefix + f.name, f.default, f.metadata.get("help", ""), False))
    return rows


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The `ModelConfig` a training config describes (its preset with fields overridden)."""
    m = dataclasses.asdict(cfg.model)
    preset = m.pop("preset")
    over = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in m.items() if v is not None}
    if isinstance(over.get("ladder_layers"), list):
        over["ladder_layers"] = tuple(over["ladder_layers"])
    if isinstance(over.get("reduce_pattern"), list):
        over["reduce_pattern"] = tuple(tuple(p) for p in over["reduce_pattern"])
    try:
        return ModelConfig.from_preset(preset, **over)
    except ConfigError as e:
        raise ConfigError(f"model: {e}") from None


_POSITIVE = (
    "steps",
    "log_every",
    "bench_steps",
    "eval_batches",
    "keep",
    "max_bad_steps",
    "data.seq_len",
    "data.batch_size",
    "data.grad_accum",
    "mesh.tp",
    "optim.peak_lr",
    "optim.eps",
    "optim.grad_clip",
    "distill.temperature",
)
_RANGES = {  # key: (low, high, closed at high)
    "data.eval_fraction": (0.0, 1.0, False),
    "optim.end_lr_fraction": (0.0, 1.0, True),
    "optim.b1": (0.0, 1.0, False),
    "optim.b2": (0.0, 1.0, False),
    "distill.weight": (0.0, 1.0, True),
}


def check(cfg: TrainConfig) -> ModelConfig:
    """Everything about a training config that can be checked without data or devices;
    returns its `ModelConfig`. Raises ConfigError naming the key. A desync model's unset
    desync_tp is fixed here to mesh.tp, in `cfg` too, so the run records its streams."""
    if cfg.model.residual == "desync" and cfg.model.desync_tp is None:
        cfg.model.desync_tp = cfg.mesh.tp
    model = model_config(cfg)
    if model.quantize is not None:
        raise ConfigError(
            f"model.quantize={model.quantize}: training runs on float weights; "
            f"quantize for decoding (decode --quantize, convert --quantize) and "
            f"train from the float model"
        )
    node = OmegaConf.structured(cfg)
    for key in _POSITIVE:
        v = OmegaConf.select(node, key)
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"{key}={v} must be positive")
    for key, (low, high, closed) in _RANGES.items():
        v = OmegaConf.select(node, key)
        if not (low <= v < high or (closed and v == high)):
            raise ConfigError(f"{key}={v} must be in [{low}, {high}{']' if closed else ')'}")
    for key in (
        "optim.warmup_steps",
        "optim.weight_decay",
        "eval_every",
        "ckpt_every",
        "loss_chunk",
    ):
        v = OmegaConf.select(node, key)
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise ConfigError(f"{key}={v} must be >= 0")
    if not 0 <= cfg.data.seed < 2**32:
        raise ConfigError(f"data.seed={cfg.data.seed} must be in [0, 2**32) (the shuffle's seed)")
    if not -(2**63) <= cfg.seed < 2**63:
        raise ConfigError(f"seed={cfg.seed} does not fit in 64 bits")
    if cfg.peak_tflops is not None and not (cfg.peak_tflops > 0 and math.isfinite(cfg.peak_tflops)):
        raise ConfigError(
            f"peak_tflops={cfg.peak_tflops} must be positive (or null: known GPUs only)"
        )
    if cfg.mesh.data is not None and cfg.mesh.data <= 0:
        raise ConfigError(
            f"mesh.data={cfg.mesh.data} must be positive (or null: the devices left over)"
        )
    if cfg.mesh.cpu_devices is not None and cfg.mesh.cpu_devices <= 0:
        raise ConfigError(f"mesh.cpu_devices={cfg.mesh.cpu_devices} must be positive")
    if cfg.data.seq_len > model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len="
            f"{model.max_seq_len}: set model.max_seq_len"
        )
    if cfg.progress not in ("auto", "bar", "lines", "none"):
        raise ConfigError(f"progress={cfg.progress!r}: choose auto, bar, lines or none")
    if os.path.exists(cfg.run_dir) and not os.path.isdir(cfg.run_dir):
        raise ConfigError(f"run_dir={cfg.run_dir!r} is a file: give a directory")
    name = cfg.name
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(
            f"name={name!r} must be a plain directory name (no '/' and not '..'):"
            f" the run is written to run_dir/name; to write elsewhere set "
            f"run_dir="
        )
    return model
