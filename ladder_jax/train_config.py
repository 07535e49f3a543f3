"""A training run's configuration: `TrainConfig`, the schema of `python -m ladder_jax.train` (its
model section derived from `ModelConfig`'s fields, each field with its help text), and
`load_config`: YAML files merged left to right, then `key=value` overrides, an error naming the
key or the file and line. Imports neither jax's backends nor the rest of the package.

    cfg = load_config(["configs/tiny.yaml", "model.residual=ladder"])"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from ladder_jax.config import PRESETS, REMAT, SCHEMES, ConfigError, ModelConfig, doc


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

    peak_lr: float = doc("learning rate after warmup", 3e-4)
    warmup_steps: int = doc("linear warmup from 0", 100)
    end_lr_fraction: float = doc("cosine decay ends at peak_lr x this", 0.1)
    b1: float = doc("AdamW beta 1", 0.9)
    b2: float = doc("AdamW beta 2", 0.95)
    eps: float = doc("AdamW epsilon", 1e-10)
    weight_decay: float = doc("AdamW decoupled weight decay", 0.1)
    grad_clip: float = doc("clip the global gradient norm to this", 1.0)


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
    return (f.name, Optional[typ], doc(f.metadata["help"], _SECTION_DEFAULTS.get(f.name)))


ModelSection = dataclasses.make_dataclass(
    "ModelSection",
    [
        (
            "preset",
            str,
            doc(f"the ModelConfig preset the other keys change: {', '.join(PRESETS)}", "tiny"),
        )
    ]
    + [_section_field(f) for f in dataclasses.fields(ModelConfig)],
)
ModelSection.__module__ = __name__
ModelSection.__doc__ = """A `ModelConfig` preset with fields overridden (null = the preset's
value): the model section of a training config, derived from ModelConfig's fields."""


@dataclasses.dataclass
class DataSection:
    path: Optional[str] = doc(
        "a text file, glob, directory or .npy token arrays (null: the embedded corpus)", None
    )
    tokenizer: str = doc("byte, or a local tokenizer.json", "byte")
    seq_len: int = doc("tokens per sequence", 256)
    batch_size: int = doc("sequences per micro-batch, global (all processes)", 16)
    grad_accum: int = doc("micro-batches per step", 1)
    eval_fraction: float = doc("held-out share of the records", 0.05)
    seed: int = doc("shuffle seed", 0)


@dataclasses.dataclass
class MeshSection:
    tp: int = doc("tensor-parallel size", 1)
    data: Optional[int] = doc(
        "data-parallel size (null: the devices left over; on a CPU host, one fake device "
        "per core over tp while a copy of the training state is under 1 GiB, else 1)",
        None,
    )
    fsdp: bool = doc("also shard weights and optimizer state over `data`", False)
    cpu_devices: Optional[int] = doc(
        "CPU host: fake devices to make (null: what the mesh needs)", None
    )


@dataclasses.dataclass
class DistSection:
    coordinator_address: Optional[str] = doc(
        "host:port of process 0 (or JAX_COORDINATOR_ADDRESS)", None
    )
    num_processes: Optional[int] = doc("processes in all (or JAX_NUM_PROCESSES)", None)
    process_id: Optional[int] = doc("this process, 0..N-1 (or JAX_PROCESS_ID)", None)


@dataclasses.dataclass
class DistillSection:
    teacher: Optional[str] = doc(
        "distill from this frozen model (run, convert output, HF "
        "directory, GGUF file; null: plain fine-tuning)",
        None,
    )
    weight: float = doc(
        "share of the KL to the teacher in the loss (the rest: cross-entropy on the data)", 1.0
    )
    temperature: float = doc("softmax temperature of both distributions in the KL", 1.0)


def _section(cls, text: str):
    return dataclasses.field(default_factory=cls, metadata={"help": text})


@dataclasses.dataclass
class TrainConfig:
    name: str = doc("the run's directory is <run_dir>/<name>", "run")
    run_dir: str = doc("where runs live", "runs")
    steps: int = doc("optimizer steps in all (a resumed run continues to this)", 1000)
    seed: int = doc("weight init seed", 0)
    log_every: int = doc("a progress line every this many steps", 10)
    eval_every: int = doc("held-out loss every this many steps (0: only at the end)", 200)
    eval_batches: int = doc("held-out batches per evaluation", 8)
    loss_chunk: Optional[int] = doc(
        "cross-entropy over this many positions of each sequence at a time, "
        "so that the float32 logits and their gradient are never whole "
        "(0: all at once; null: 64 when a step's float32 logits would exceed 64 MiB, "
        "as with large vocabularies, else 0; same loss up to rounding)",
        None,
    )
    ckpt_every: int = doc(
        "a checkpoint every this many steps (0: only at the end and on SIGTERM)", 200
    )
    keep: int = doc("checkpoints kept", 3)
    async_ckpt: bool = doc("write checkpoints while training goes on", True)
    max_bad_steps: int = doc("non-finite steps in a row before the run stops (exit 3)", 5)
    accept_changes: bool = doc(
        "resume although model / data / optimizer keys changed (recorded in changes.jsonl)", False
    )
    init_from: Optional[str] = doc(
        "weights only, from a run or checkpoint directory (for fine-tuning)", None
    )
    progress: Progress = doc(
        "auto (a bar on a terminal, else lines) | bar | lines | none", Progress.auto
    )
    tensorboard: Optional[bool] = doc(
        "event files in <run>/tensorboard (null: if tensorboardX is installed)", None
    )
    benchmark: bool = doc("time every residual scheme's step instead of training", False)
    bench_steps: int = doc("benchmark: timed rounds", 5)
    peak_tflops: Optional[float] = doc("per device, for MFU (null: known GPUs only)", None)
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
