"""Hugging Face LlamaForCausalLM as the peer of ladder_jax's CPU benchmarks (hf_decode.py,
hf_train_step.py, int8_decode.py): a float32 model with random weights and the shapes of a
ladder_jax `ModelConfig`, and the torch flags the scripts share.

    import _hf  # a script run from benchmarks/ has this folder on sys.path
    model = _hf.llama(_hf.model_config("small"), attn="sdpa", threads=4)
    model = _hf.llama(_hf.llama_fields_apart("smollm2"))  # this process never imports jax

The LlamaConfig is read off `ladder_jax.interop.hf.hf_config` (what `save_hf` writes), so a
peer has its ModelConfig's shapes, norm epsilon and RoPE base by construction. Importing this
module imports neither jax nor ladder_jax: a peer whose peak memory is measured
(hf_train_step.py) takes its fields from a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {  # the models the peers build (float32 on CPU): changes to the small preset
    "small": {},
    # SmolLM2-135M's shapes (30 layers, 9 / 3 heads, tied head), vocabulary included
    "smollm2": {
        "vocab_size": 49152,
        "d_model": 576,
        "n_layers": 30,
        "n_heads": 9,
        "n_kv_heads": 3,
        "d_ff": 1536,
        "max_seq_len": 8192,
        "rope_theta": 100000.0,
        "tie_embeddings": True,
    },
}
_FIELDS = (  # hf_config's keys a LlamaConfig takes as they are
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
)


def add_torch_args(ap) -> None:
    """--threads (default: every core, as XLA:CPU uses them all) and --attn on `ap`."""
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--attn", default="sdpa", choices=("sdpa", "eager"), help="HF attention implementation"
    )


def model_config(shape: str):
    """The ladder_jax `ModelConfig` of `SHAPES[shape]`."""
    from ladder_jax.config import ModelConfig

    return ModelConfig.from_preset("small", **SHAPES[shape])


def llama_fields(config) -> dict:
    """The LlamaConfig keyword arguments of a ladder_jax `ModelConfig`."""
    from ladder_jax.interop.hf import hf_config

    return {k: v for k, v in hf_config(config).items() if k in _FIELDS}


def llama_fields_apart(shape: str) -> dict:
    """`llama_fields(model_config(shape))` worked out in a child process, so that this
    process's peak RSS holds no jax."""
    code = f"import json, _hf; print(json.dumps(_hf.llama_fields(_hf.model_config({shape!r}))))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def llama(config, *, attn: str = "sdpa", threads: int | None = None, seed: int = 0):
    """LlamaForCausalLM in float32 of `config` (a ModelConfig, or `llama_fields`' dict), weights
    drawn after `torch.manual_seed(seed)` (the same seed, the same weights); `threads` sets
    torch's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    fields = config if isinstance(config, dict) else llama_fields(config)
    return LlamaForCausalLM(
        LlamaConfig(**fields, attn_implementation=attn, torch_dtype=torch.float32)
    )
