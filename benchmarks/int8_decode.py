"""Decode tokens/s on this CPU: ladder_jax float32 and int8 weights, beside Hugging Face
LlamaForCausalLM in float32 and with PyTorch's dynamic int8 quantization of its Linear layers
(`torch.ao.quantization.quantize_dynamic`), same shapes, same threads.

Shapes: the `small` preset (d_model 256, 8 layers, 8 / 4 heads, SwiGLU 768, vocabulary 320)
and a 125M Llama (d_model 768, 12 layers, 12 heads, SwiGLU 2048, vocabulary 32000, untied
head). Random weights, greedy, a prompt of --prompt-len tokens, --new-tokens new ones; decode
tokens/s = batch x (new tokens - 1) / (generation time - prefill time), best of --repeats,
after a warm-up. ladder_jax runs on one CPU device (XLA:CPU threads over every core); torch
gets --threads (default: every core).

On a CPU, ladder_jax decodes an int8 model through its dequantized float copy (XLA:CPU's int8
matmuls are ~10x slower than float32; see `ladder_jax.model.quant`), so its int8 figure is its
float32 speed: int8 buys speed on GPUs, where the program reads the int8 bytes.

    python benchmarks/int8_decode.py [--shapes small 125m] [--batch 1 16] [--threads N]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import _hf
import torch

from ladder_jax.config import ModelConfig
from ladder_jax.inference import generation
from ladder_jax.model import sharding

SHAPES = {
    "small": dict(vocab_size=320, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=768),
    "125m": dict(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048),
}


def model_config(shape: str) -> ModelConfig:
    """The float32 model both systems run at `shape`."""
    return ModelConfig.from_preset("small", **SHAPES[shape], max_seq_len=1024)  # head_dim: D / N


def ladder(shape: str, batch: int, prompt_len: int, new_tokens: int, quantize, repeats: int):
    r = generation.benchmark(
        dataclasses.replace(model_config(shape), quantize=quantize),
        sharding.make_mesh(tp=1),
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        repeats=repeats,
    )
    return r["decode_tokens_per_s"]


def hf(shape: str, batch: int, prompt_len: int, new_tokens: int, quantize, repeats: int):
    config = model_config(shape)
    model = _hf.llama(config).eval()
    if quantize:
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    ids = torch.randint(
        0,
        min(256, config.vocab_size),
        (batch, prompt_len),
        generator=torch.Generator().manual_seed(0),
    )

    def gen(n):
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t0

    gen(2)  # warm-up
    prefill = min(gen(1) for _ in range(repeats))
    total = min(gen(new_tokens) for _ in range(repeats))
    return batch * (new_tokens - 1) / max(total - prefill, 1e-9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    sharding.setup_host(1)
    torch.set_num_threads(args.threads)
    print(
        f"decode tokens/s, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"{args.threads} torch threads, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'shape':<6} {'batch':>5} {'ladder fp32':>12} {'ladder int8':>12} "
        f"{'hf fp32':>10} {'hf int8':>10}"
    )
    for shape in args.shapes:
        for b in args.batch:
            kw = dict(
                batch=b,
                prompt_len=args.prompt_len,
                new_tokens=args.new_tokens,
                repeats=args.repeats,
            )
            row = [
                ladder(shape, quantize=None, **kw),
                ladder(shape, quantize="int8", **kw),
                hf(shape, quantize=False, **kw),
                hf(shape, quantize=True, **kw),
            ]
            print(
                f"{shape:<6} {b:>5} "
                + " ".join(f"{v:>12.1f}" if i < 2 else f"{v:>10.1f}" for i, v in enumerate(row)),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
