"""Every configuration in one place: the model's (`ModelConfig`, named presets) and a training
run's (`TrainConfig`, the schema of `python -m ladder_jax.train`), their checks, and the one
`ConfigError` that every command-line tool turns into a one-line message and exit code 2.

    config = ModelConfig.from_preset("llama-3-8b", residual="ladder", ladder_layers=16)
    cfg = load_config(["configs/tiny.yaml", "model.residual=ladder"])   # a TrainConfig
    check(cfg); model_config(cfg)                                         # a ModelConfig

Training configs are OmegaConf structured configs: YAML files merge left to right, then dotted
`key=value` overrides. An unknown key, a value of the wrong type or out of range, or a YAML
syntax error is a `ConfigError` naming the key (and the closest valid one) or the file and line.

Nothing here imports jax's backends or the rest of the package: every other module may import
this one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Optional

import jax.numpy as jnp
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors


class ConfigError(ValueError):
    """A configuration that cannot be built or run; the message names the key / field and the
    fix. The command-line tools print it as one line and exit 2."""


# ---------------------------------------------------------------------------------------------
# The model.

RESIDUALS = ("standard", "parallel", "ladder", "upper_bound")

# Activation rematerialization for training. "none": the backward reads what the forward
# stored (every module's intermediate activations). "module": each module (attention, MLP;
# a parallel layer's pair) stores only its input and recomputes its internals (its norm
# included) in the backward: about one extra forward of compute for activation memory that
# no longer grows with d_ff or the number of heads (one stream-sized array per module). The ladder's backward still overlaps its all-reduces
# (the recomputation is more matmul work beside them).
REMAT = ("none", "module")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """llama-3 style RoPE frequency scaling (long wavelengths slowed by `factor`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int | None = None  # default d_model // n_heads
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    residual: str = "standard"
    ladder_layers: int | tuple[int, ...] | None = None  # ladder only: None = all layers
    dtype: str = "float32"  # matmul compute dtype
    param_dtype: str = "float32"
    remat: str = "none"  # training memory: see REMAT (the function computed is the same)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                    f"set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if not _is_int(self.head_dim) or self.head_dim <= 0:
            raise ConfigError(f"head_dim={self.head_dim!r} must be a positive even integer "
                              f"(or unset: d_model // n_heads)")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        for name, usual in (("rope_theta", "10000 or 500000"), ("norm_eps", "1e-5 or 1e-6")):
            v = getattr(self, name)  # 0 or negative: every step is NaN
            if not _is_number(v) or not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{name}={v!r} must be a positive finite number (usually "
                                  f"{usual})")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"tie_embeddings={self.tie_embeddings!r} must be true or false")
        object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        if self.residual not in RESIDUALS:
            close = difflib.get_close_matches(str(self.residual), RESIDUALS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown residual scheme {self.residual!r}{hint}: choose one of "
                f"{', '.join(RESIDUALS)}")
        if self.remat not in REMAT:
            raise ConfigError(f"remat={self.remat!r}: choose one of {', '.join(REMAT)}")
        for name in ("dtype", "param_dtype"):
            v = getattr(self, name)
            try:
                dt = jnp.dtype(v)
            except TypeError:
                dt = None
            if dt is None or not jnp.issubdtype(dt, jnp.floating):
                why = "is not a dtype name" if dt is None else "is not a floating-point dtype"
                raise ConfigError(f"{name}={v!r} {why}: choose float32, bfloat16 or float16")
        ll = self.ladder_layers
        if ll is None:
            return
        if self.residual != "ladder":
            raise ConfigError(
                f"ladder_layers={ll!r} is set but residual={self.residual!r}: ladder_layers "
                f"only applies to residual='ladder'")
        if isinstance(ll, bool):
            raise ConfigError(f"ladder_layers={ll!r} must be an int or a list of layer indices")
        if isinstance(ll, int):
            if not 0 <= ll <= self.n_layers:
                raise ConfigError(
                    f"ladder_layers={ll} must be between 0 and n_layers={self.n_layers}")
            return
        idx = tuple(ll)
        bad = [i for i in idx if not isinstance(i, int) or not 0 <= i < self.n_layers]
        if bad or len(set(idx)) != len(idx):
            raise ConfigError(
                f"ladder_layers={list(idx)} must be distinct layer indices in "
                f"[0, {self.n_layers})")
        object.__setattr__(self, "ladder_layers", tuple(sorted(idx)))

    # -- presets ---------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named preset (see `PRESETS`), with any field overridden by keyword."""
        if name not in PRESETS:
            close = difflib.get_close_matches(name, PRESETS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown preset {name!r}{hint}: choose one of {', '.join(PRESETS)}")
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
        raise ConfigError(f"rope_scaling={v!r} must be null or a mapping of {', '.join(fields)}"
                          f" (llama-3's: factor 8, low_freq_factor 1, high_freq_factor 4, "
                          f"original_max_len 8192)")
    unknown = [k for k in v if k not in fields]
    if unknown:
        raise ConfigError(f"rope_scaling has no field {unknown[0]!r}: its fields are "
                          f"{', '.join(fields)}")
    r = RopeScaling(**v)
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        x = getattr(r, name)
        if not _is_number(x) or not (x > 0 and math.isfinite(x)):
            raise ConfigError(f"rope_scaling.{name}={x!r} must be a positive finite number")
    if not r.high_freq_factor > r.low_freq_factor:
        raise ConfigError(f"rope_scaling.high_freq_factor={r.high_freq_factor} must be larger "
                          f"than low_freq_factor={r.low_freq_factor}")
    if not _is_int(r.original_max_len) or r.original_max_len <= 0:
        raise ConfigError(f"rope_scaling.original_max_len={r.original_max_len!r} must be a "
                          f"positive integer")
    return r


PRESETS: dict[str, dict] = {  # ModelConfig fields; head_dim is derived unless given
    # CPU-sized, byte-level vocabulary (256 bytes + specials, padded to a multiple of 16).
    "tiny": dict(vocab_size=320, d_model=64, n_layers=4, n_heads=8, n_kv_heads=4,
                        d_ff=128, max_seq_len=256),
    "small": dict(vocab_size=320, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                         d_ff=768, max_seq_len=512),
    # The paper's inference-benchmark shapes (ICML 2025, arXiv 2501.06589).
    "1b": dict(vocab_size=49152, d_model=1536, n_layers=40, n_heads=24, n_kv_heads=24,
                      d_ff=4096, dtype="bfloat16", param_dtype="bfloat16"),
    "3b": dict(vocab_size=49152, d_model=2304, n_layers=40, n_heads=32, n_kv_heads=32,
                      d_ff=9216, dtype="bfloat16", param_dtype="bfloat16"),
    "llama-3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, d_ff=14336, max_seq_len=8192, rope_theta=500000.0,
                              dtype="bfloat16", param_dtype="bfloat16"),
    "34b": dict(vocab_size=32000, d_model=8192, n_layers=48, n_heads=64, n_kv_heads=8,
                       d_ff=22016, max_seq_len=16384, rope_theta=1000000.0,
                       dtype="bfloat16", param_dtype="bfloat16"),
    "llama-3-70b": dict(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                               n_kv_heads=8, d_ff=28672, max_seq_len=8192,
                               rope_theta=500000.0, dtype="bfloat16", param_dtype="bfloat16"),
    "llama-3.1-405b": dict(vocab_size=128256, d_model=16384, n_layers=126, n_heads=128,
                                  n_kv_heads=16, d_ff=53248, max_seq_len=131072,
                                  rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0),
                                  dtype="bfloat16", param_dtype="bfloat16"),
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
        raise ConfigError(f"--ladder-layers {text!r}: give N (the upper N layers) or a comma "
                          f"list of layer indices, e.g. 0,2,4") from None


def scheme_overrides(residual: str | None, ladder_layers) -> dict:
    """ModelConfig overrides for the command-line flags --residual / --ladder-layers: a
    scheme alone drops any ladder_layers; ladder_layers alone implies residual="ladder"."""
    if ladder_layers is not None:
        if residual not in (None, "ladder"):
            raise ConfigError(f"--ladder-layers applies to --residual ladder, not {residual!r}")
        return {"residual": "ladder", "ladder_layers": ladder_layers}
    return {} if residual is None else {"residual": residual, "ladder_layers": None}


# ---------------------------------------------------------------------------------------------
# A training run.


@dataclasses.dataclass
class OptimizerConfig:
    """The optimizer's settings, with the paper's defaults; also the `optim` section of a
    training config (mutable, as OmegaConf merges YAML into it)."""

    peak_lr: float = 3e-4
    warmup_steps: int = 100
    end_lr_fraction: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-10
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclasses.dataclass
class ModelSection:
    """A `ModelConfig` preset with fields overridden (null = the preset's value)."""

    preset: str = "tiny"
    residual: str = "standard"  # standard | parallel | ladder | upper_bound
    ladder_layers: Optional[Any] = None  # ladder only: int (upper N layers) or list of indices
    n_layers: Optional[int] = None
    d_model: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    d_ff: Optional[int] = None
    head_dim: Optional[int] = None
    vocab_size: Optional[int] = None
    max_seq_len: Optional[int] = None
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Any] = None  # llama-3 scaling: {factor, low_freq_factor, ...}
    norm_eps: Optional[float] = None
    tie_embeddings: Optional[bool] = None
    dtype: Optional[str] = None  # matmul compute dtype, e.g. bfloat16
    param_dtype: str = "float32"  # params and optimizer state
    remat: Optional[str] = None  # none | module: recompute module internals in the backward


@dataclasses.dataclass
class DataSection:
    path: Optional[str] = None  # file, glob, directory or .npy files; null = embedded corpus
    tokenizer: str = "byte"  # or a local tokenizer.json
    seq_len: int = 256
    batch_size: int = 16  # sequences per micro-batch, global (all processes)
    grad_accum: int = 1  # micro-batches per step
    eval_fraction: float = 0.05  # held-out share of the records
    seed: int = 0  # shuffle seed


@dataclasses.dataclass
class MeshSection:
    tp: int = 1
    data: Optional[int] = None  # null = the devices left over
    fsdp: bool = False  # also shard params and optimizer state over `data`
    cpu_devices: Optional[int] = None  # CPU host: fake devices to make (null: what the mesh needs)


@dataclasses.dataclass
class DistSection:
    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None


@dataclasses.dataclass
class TrainConfig:
    name: str = "run"  # run directory: <run_dir>/<name>
    run_dir: str = "runs"
    steps: int = 1000
    seed: int = 0  # weight init
    log_every: int = 10
    eval_every: int = 200  # 0: only at the end
    eval_batches: int = 8
    ckpt_every: int = 200  # 0: only at the end (and on SIGTERM)
    keep: int = 3  # checkpoints kept
    async_ckpt: bool = True
    max_bad_steps: int = 5  # consecutive non-finite steps before stopping
    accept_changes: bool = False  # resume although the model / data / optimizer keys changed
    init_from: Optional[str] = None  # weights only, from a run or checkpoint directory
    progress: str = "auto"  # auto | bar | lines | none
    tensorboard: Optional[bool] = None  # event files in <run>/tensorboard; null: if installed
    benchmark: bool = False  # time every residual scheme instead of training
    bench_steps: int = 5
    peak_tflops: Optional[float] = None  # per device, for MFU; null = known GPUs only
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    dist: DistSection = dataclasses.field(default_factory=DistSection)


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
            k for k in keys if k.rsplit(".", 1)[-1] in difflib.get_close_matches(
                leaf, [k.rsplit(".", 1)[-1] for k in keys], n=1)][:1]
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
                cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([a]))
            else:
                cfg = OmegaConf.merge(cfg, _read_yaml(a))
        return OmegaConf.to_object(cfg)
    except oc_errors.ConfigKeyError as e:
        key = e.full_key or str(e.key)
        where = f"{a}: " if isinstance(a, str) and "=" not in a else ""
        raise ConfigError(f"{where}unknown config key {key!r}{_closest(key)}") from None
    except oc_errors.ValidationError as e:
        section = a.split("=", 1)[0] if isinstance(a, str) and "=" in a else None
        if not e.full_key and section in {f.name for f in dataclasses.fields(TrainConfig)}:
            raise ConfigError(f"config key {section!r} is a section, not a value: set its keys "
                              f"(e.g. {_keys()[[k.split('.')[0] for k in _keys()].index(section)]}"
                              f"=...), got {a!r}") from None
        field = _field(e.full_key)
        want = getattr(field, "type", None)
        want = getattr(want, "__name__", None) or str(want).replace("typing.", "")
        raise ConfigError(f"config key {e.full_key!r} must be {want}, got {e.value!r}") from None
    except oc_errors.OmegaConfBaseException as e:
        raise ConfigError(f"bad config: {str(e).splitlines()[0]}") from None
    except Exception as e:  # YAML syntax errors and the like
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"cannot read the config: {str(e).splitlines()[0]}") from None


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
        raise ConfigError(f"{path}: a config file must be a mapping of keys (model:, data:, "
                          f"...), not a {type(node).__name__}")
    return node


def _field(full_key: str):
    node = TrainConfig
    field = None
    for part in (full_key or "").split("."):
        field = {f.name: f for f in dataclasses.fields(node)}.get(part) if node else None
        if field is None:
            return None
        node = field.default_factory if dataclasses.is_dataclass(
            getattr(field, "default_factory", None)) else None
    return field


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The `ModelConfig` a training config describes (its preset with fields overridden)."""
    m = dataclasses.asdict(cfg.model)
    preset = m.pop("preset")
    over = {k: v for k, v in m.items() if v is not None}
    if isinstance(over.get("ladder_layers"), list):
        over["ladder_layers"] = tuple(over["ladder_layers"])
    try:
        return ModelConfig.from_preset(preset, **over)
    except ConfigError as e:
        raise ConfigError(f"model: {e}") from None




_POSITIVE = ("steps", "log_every", "bench_steps", "eval_batches", "keep", "max_bad_steps",
             "data.seq_len", "data.batch_size", "data.grad_accum", "mesh.tp",
             "optim.peak_lr", "optim.eps", "optim.grad_clip")
_RANGES = {  # key: (low, high, closed at high)
    "data.eval_fraction": (0.0, 1.0, False), "optim.end_lr_fraction": (0.0, 1.0, True),
    "optim.b1": (0.0, 1.0, False), "optim.b2": (0.0, 1.0, False),
}


def check(cfg: TrainConfig) -> ModelConfig:
    """Everything about a training config that can be checked without data or devices;
    returns its `ModelConfig`. Raises ConfigError naming the key."""
    model = model_config(cfg)
    node = OmegaConf.structured(cfg)
    for key in _POSITIVE:
        v = OmegaConf.select(node, key)
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"{key}={v} must be positive")
    for key, (low, high, closed) in _RANGES.items():
        v = OmegaConf.select(node, key)
        if not (low <= v < high or (closed and v == high)):
            raise ConfigError(f"{key}={v} must be in [{low}, {high}{']' if closed else ')'}")
    for key in ("optim.warmup_steps", "optim.weight_decay", "eval_every", "ckpt_every"):
        v = OmegaConf.select(node, key)
        if not (v >= 0 and math.isfinite(v)):
            raise ConfigError(f"{key}={v} must be >= 0")
    if not 0 <= cfg.data.seed < 2**32:
        raise ConfigError(f"data.seed={cfg.data.seed} must be in [0, 2**32) (the shuffle's seed)")
    if not -2**63 <= cfg.seed < 2**63:
        raise ConfigError(f"seed={cfg.seed} does not fit in 64 bits")
    if cfg.peak_tflops is not None and not (cfg.peak_tflops > 0 and math.isfinite(
            cfg.peak_tflops)):
        raise ConfigError(f"peak_tflops={cfg.peak_tflops} must be positive (or null: known "
                          f"GPUs only)")
    if cfg.mesh.data is not None and cfg.mesh.data <= 0:
        raise ConfigError(f"mesh.data={cfg.mesh.data} must be positive (or null: the devices "
                          f"left over)")
    if cfg.mesh.cpu_devices is not None and cfg.mesh.cpu_devices <= 0:
        raise ConfigError(f"mesh.cpu_devices={cfg.mesh.cpu_devices} must be positive")
    if cfg.data.seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len="
                          f"{model.max_seq_len}: set model.max_seq_len")
    if cfg.progress not in ("auto", "bar", "lines", "none"):
        raise ConfigError(f"progress={cfg.progress!r}: choose auto, bar, lines or none")
    if os.path.exists(cfg.run_dir) and not os.path.isdir(cfg.run_dir):
        raise ConfigError(f"run_dir={cfg.run_dir!r} is a file: give a directory")
    name = cfg.name
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(f"name={name!r} must be a plain directory name (no '/' and not '..'):"
                          f" the run is written to run_dir/name; to write elsewhere set "
                          f"run_dir=")
    return model
