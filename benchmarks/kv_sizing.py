"""What serve's default KV-cache sizing chooses (`ladder_jax.inference.sizing.plan_kv`) for a few
models on a 24 GB CPU host and an 80 GB GPU, from stated memory figures (no machine needed).

    python benchmarks/kv_sizing.py

CPU: the free memory is the host's available memory before loading (--host-available GiB,
default 23: a 24 GB host's kernel and services take the rest) less the weights. GPU: jax's
memory pool is 75% of the device (its default XLA_PYTHON_CLIENT_MEM_FRACTION), less the
weights. The cache is a pool of pages of 16 positions shared by the 16 slots (`plan_kv`).
Prints a markdown table."""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from ladder_jax.config import ConfigError, ModelConfig
from ladder_jax.inference import sizing

GiB = 2**30
SMOLLM2 = dict(  # SmolLM2-135M-Instruct as `convert` writes it (float32)
    vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
    head_dim=64, max_seq_len=8192, rope_theta=1e5, tie_embeddings=True,
)  # fmt: skip
MODELS = {"SmolLM2-135M (fp32)": ("tiny", SMOLLM2), "llama-3-8b (bf16)": ("llama-3-8b", {})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host-available", type=float, default=23.0, help="GiB, before loading")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB of device memory")
    p.add_argument("--gpu-pool", type=float, default=0.75, help="jax's share of it")
    args = p.parse_args()
    hosts = {
        "24 GB CPU host": ("cpu", args.host_available * GiB),
        f"{args.gpu_memory:g} GB GPU": ("gpu", args.gpu_pool * args.gpu_memory * GiB),
    }
    print(
        "| model | machine | free after weights | fraction | slots, positions each | pages "
        "(at full length) | KV cache |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, (preset, changes) in MODELS.items():
        config = ModelConfig.from_preset(preset, **changes)
        weights = config.num_params() * jnp.dtype(config.param_dtype).itemsize
        for machine, (platform, memory) in hosts.items():
            free = int(memory - weights)
            fraction = sizing.DEFAULT_FRACTION[platform]
            where = "of host memory" if platform == "cpu" else "on each device"
            try:
                plan = sizing.plan_kv(
                    config,
                    1,
                    slots=16,
                    max_len=None,
                    free=free,
                    fraction=fraction,
                    where=where,
                )
                chose = (
                    f"{plan.slots}, {plan.positions:,}",
                    f"{plan.pages - 1:,} ({plan.full_length})",
                    sizing.size_text(plan.kv_bytes),
                )
            except ConfigError as e:
                chose = "error", "", str(e)
            print(
                f"| {label} | {machine} | {sizing.size_text(free)} | {fraction:g} | "
                + " | ".join(chose)
                + " |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
