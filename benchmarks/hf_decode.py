"""Prefill latency and decode tokens/s of Hugging Face LlamaForCausalLM on CPU, as a peer
figure for

    python -m ladder_jax.decode --preset small --benchmark --residual standard --tp 1 \\
        --cpu-devices 1 --batch 16 --prompt-len 128 --max-new-tokens 64

Same shapes and protocol as ladder_jax's benchmark (`ladder_jax.inference.generation.benchmark`):
the `small` preset (d_model 256, 8 layers, 8 query / 4 kv heads, SwiGLU hidden 768,
vocabulary 320, untied head), float32, random weights, batch B of random prompts of P tokens,
N new tokens greedy with a KV cache; the prefill (which emits the first token) and the N-1
decode steps are timed apart, best of `--repeats` after one warm-up run; decode tokens/s
counts B x (N-1) decode tokens over the decode time, end-to-end tokens/s all B x N new tokens
over prefill + decode (ladder_jax's `end-to-end`). XLA:CPU uses every core of the host, so torch
gets as many threads unless told otherwise. Prints the CPU model and torch's threads.

    python benchmarks/hf_decode.py [--batch 16] [--prompt-len 128] [--new-tokens 64]
        [--threads N] [--attn sdpa|eager] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import _hf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    _hf.add_torch_args(ap)
    args = ap.parse_args(argv)

    import torch
    from transformers import DynamicCache

    from ladder_jax.hardware import cpu_description

    model = _hf.llama(_hf.model_config("small"), attn=args.attn, threads=args.threads).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (args.batch, args.prompt_len), generator=gen)

    @torch.inference_mode()
    def run():
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        for _ in range(args.new_tokens - 1):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return t1 - t0, time.perf_counter() - t1

    run()  # warm-up
    times = [run() for _ in range(args.repeats)]
    prefill_s = min(t[0] for t in times)
    decode_s = min(t[1] for t in times)
    steps = args.new_tokens - 1
    print(
        f"hf LlamaForCausalLM decode ({args.attn}, {args.threads} threads, torch "
        f"{torch.__version__}, {cpu_description()}): prefill {prefill_s * 1e3:.1f} ms, decode "
        f"{args.batch * steps / decode_s:,.0f} tokens/s ({decode_s / steps * 1e3:.2f} "
        f"ms/step), end-to-end {args.batch * args.new_tokens / (prefill_s + decode_s):,.0f} "
        f"tokens/s (batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
