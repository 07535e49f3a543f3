"""ladder_jax: the Ladder Transformer (arXiv 2501.06589) in JAX, with explicit tensor parallelism;
the notebook API (`lj.fit`, `lj.load`, `lj.generate`, ...) is `ladder_jax.api`.

    model = lj.Transformer(lj.ModelConfig.from_preset("tiny", residual="ladder"),
                           mesh=lj.make_mesh(tp=8), rngs=nnx.Rngs(0))"""

from ladder_jax import runtime as _runtime

with _runtime.quiet():  # the CUDA plugin's start-up chatter on hosts without a GPU
    _runtime.hush_missing_cuda()  # and jax's log record when that plugin finds no CUDA
    import jax  # noqa: F401

from ladder_jax import hardware  # noqa: E402
from ladder_jax.api import Run, evaluate, fit, generate, load, overlap_table, predict
from ladder_jax.config import PRESETS, RESIDUALS, ConfigError, ModelConfig, RopeScaling, UsageError
from ladder_jax.interop.gguf import load_gguf
from ladder_jax.interop.hf import load_hf, save_hf
from ladder_jax.model import sharding  # noqa: E402
from ladder_jax.model.sharding import ShardingError, compiler_options, make_mesh
from ladder_jax.model.transformer import Transformer, param_specs, with_config

__all__ = [
    "hardware",
    "sharding",
    "Run",
    "evaluate",
    "fit",
    "generate",
    "load",
    "overlap_table",
    "predict",
    "PRESETS",
    "RESIDUALS",
    "ConfigError",
    "UsageError",
    "ModelConfig",
    "RopeScaling",
    "ShardingError",
    "Transformer",
    "compiler_options",
    "load_gguf",
    "load_hf",
    "make_mesh",
    "param_specs",
    "save_hf",
    "with_config",
]
