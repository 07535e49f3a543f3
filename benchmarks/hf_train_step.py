"""Tokens/s of Hugging Face LlamaForCausalLM's training step on CPU, as a peer figure for
`python -m ladder_jax.train configs/tiny.yaml benchmark=true bench_steps=10 model.preset=small
data.seq_len=128 data.batch_size=16 mesh.tp=1 mesh.data=1`.

Same work per step as ladder_jax's: the `small` preset's shapes (d_model 256, 8 layers, 8 query
/ 4 kv heads, SwiGLU hidden 768, vocabulary 320, untied head), float32, batch 16 x 128 tokens
predicting the next token, global-norm clipping at 1.0 and AdamW with the paper's settings.
`--shape smollm2` takes SmolLM2-135M's shapes instead (30 layers, d_model 576, 9 / 3 heads,
hidden 1536, vocabulary 49152, tied head; benchmarks/train_memory.py runs it beside
ladder_jax's trainer). XLA:CPU uses every core of the host, so torch gets as many threads
unless told otherwise.

    python benchmarks/hf_train_step.py [--steps 10] [--threads N] [--attn sdpa|eager]
    python benchmarks/hf_train_step.py --shape smollm2 --batch 8 --seq 256 --steps 3 --json
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import _hf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps, after 2 warm-up steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128, help="tokens predicted per row")
    _hf.add_torch_args(ap)
    ap.add_argument(
        "--shape",
        default="small",
        choices=tuple(_hf.SHAPES),
        help="the model's shapes: the small preset or SmolLM2-135M",
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument(
        "--json",
        action="store_true",
        help="also print one JSON line: tokens_per_s, step_ms, peak_rss",
    )
    args = ap.parse_args(argv)

    import torch

    fields = _hf.llama_fields_apart(args.shape)  # jax stays out of this process's peak RSS
    model = _hf.llama(fields, attn=args.attn, threads=args.threads).train()
    config = model.config
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1
    )
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen)
        for _ in range(2)
    ]

    def train_step(batch):
        tokens, targets = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    for i in range(args.warmup):
        train_step(batches[i % 2])
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = train_step(batches[i % 2])
    dt = (time.perf_counter() - t0) / args.steps
    tokens = args.batch * args.seq
    n_params = sum(p.numel() for p in model.parameters())
    from ladder_jax.hardware import cpu_description

    print(f"cpu: {cpu_description()}; torch uses {torch.backends.cpu.get_cpu_capability()} kernels")
    print(
        f"hf LlamaForCausalLM ({args.attn}, {args.threads} threads, torch "
        f"{torch.__version__}): {tokens / dt:,.0f} tokens/s  {dt * 1e3:.1f} ms/step  "
        f"(batch {args.batch} x {args.seq}, {n_params / 1e6:.2f}M params, "
        f"last loss {loss:.3f})",
        flush=True,
    )
    if args.json:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(
            json.dumps({"tokens_per_s": tokens / dt, "step_ms": dt * 1e3, "peak_rss": peak}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
