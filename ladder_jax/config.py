"""The model's configuration: `ModelConfig` (frozen) and its presets, the residual schemes and
their checks, and `UsageError` (the base of every user error; `ConfigError` for configs), which
every command-line tool turns into one line and exit code 2. A training run's schema is
`ladder_jax.train_config`.

    config = ModelConfig.from_preset("llama-3-8b", residual="ladder", ladder_layers=16)"""

from __future__ import annotations

import dataclasses
import difflib
import math

import jax.numpy as jnp


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


def doc(text: str, default=dataclasses.MISSING, **kw):
    """A dataclass field with its help text (`train --help` prints it per key)."""
    return dataclasses.field(default=default, metadata={"help": text}, **kw)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = doc(
        "tokens in the vocabulary (tp must divide it: the LM head is split over it)"
    )
    d_model: int = doc("width of the residual stream")
    n_layers: int = doc("layers, each an attention and an MLP module")
    n_heads: int = doc("query heads")
    n_kv_heads: int = doc("key / value heads (grouped-query attention; must divide n_heads)")
    d_ff: int = doc("hidden width of the SwiGLU MLP")
    head_dim: int | None = doc("width of one head (null: d_model / n_heads)", None)
    max_seq_len: int = doc("longest sequence (RoPE table, KV cache)", 2048)
    rope_theta: float = doc("RoPE base frequency", 10000.0)
    rope_scaling: RopeScaling | None = doc(
        "llama-3 RoPE scaling {factor, low_freq_factor, high_freq_factor, original_max_len} "
        "(null: none)",
        None,
    )
    norm_eps: float = doc("RMSNorm epsilon", 1e-5)
    tie_embeddings: bool = doc("the LM head is the embedding, transposed", False)
    residual: str = doc(
        "residual wiring: standard | parallel | ladder | upper_bound (a speed "
        "ceiling for benchmarks, not a valid model) | desync (per-rank streams that sync "
        "where reduce_pattern says)",
        "standard",
    )
    ladder_layers: int | tuple[int, ...] | None = doc(
        "ladder only: N (the upper N layers) or a list of layer indices (null: every layer)", None
    )
    reduce_pattern: str | tuple[tuple[bool, bool], ...] | None = doc(
        "desync only: every_layer | every_2_layers | final_only, or per layer a pair "
        "[attention syncs, mlp syncs] (null: every_layer)",
        None,
    )
    desync_tp: int | None = doc(
        "desync only: the residual streams the model carries, the tp size it is defined for "
        "(null: the mesh's tp, fixed when the model is built)",
        None,
    )
    dtype: str = doc("matmul compute dtype, e.g. bfloat16", "float32")
    param_dtype: str = doc("dtype of the weights (and of the optimizer state)", "float32")
    remat: str = doc(
        "training memory: none | module (each module keeps only its input and "
        "recomputes the rest in the backward) | matmuls (it keeps its input and its "
        "weight matmuls' outputs, recomputing norms, softmax and activations); same function",
        "none",
    )
    quantize: str | None = doc(
        "decoding only: int8 weight-only linear weights (null: float; ladder_jax.model.quant)", None
    )
    decode_matmul: str = doc(
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
