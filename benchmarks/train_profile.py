"""Where a CPU training step's time goes: ladder_jax's step on SmolLM2-135M's shapes (float32,
batch 8 x 256, AdamW, one device, `loss_chunk=64`) timed whole and in pieces, each piece its
own jitted program on the same shapes: the loss alone (forward), the loss and its gradients
(forward + backward), and the update alone (clipping and AdamW on given gradients, state
donated). `--hf` times transformers' step on the same shapes the same way (forward, backward,
update), in a process of its own.

    python benchmarks/train_profile.py --rounds 3
    python benchmarks/train_profile.py --remat none --pieces step --rounds 5
    python benchmarks/train_profile.py --hf --rounds 3

Every figure is the median over `--rounds` calls after one warm-up call; the pieces are called
in turn within each round, so that load that drifts slows them alike. The step and its pieces
sum to more than the step: the pieces write their outputs (the gradients) to memory the step
keeps inside one program.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PIECES = ("step", "forward", "grads", "update")


def jax_profile(args) -> dict:
    from ladder_jax import runtime

    runtime.setup(cpu_devices=1)
    import functools

    import _hf
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from ladder_jax.model import sharding
    from ladder_jax.model.transformer import Transformer
    from ladder_jax.train import step
    from ladder_jax.train_config import OptimizerConfig

    if args.policy:
        from ladder_jax.model import residual

        residual.MATMULS = getattr(jax.checkpoint_policies, args.policy)
    config = dataclasses.replace(_hf.model_config("smollm2"), remat=args.remat)
    mesh = sharding.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
    model = Transformer(config, mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    del model
    optimizer = step.make_optimizer(OptimizerConfig(), total_steps=1000)
    opt_state = jax.jit(optimizer.init)(params)
    p_sh, o_sh = step.shardings_of(params), step.shardings_of(opt_state)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(
        rng.integers(0, config.vocab_size, (1, args.batch, args.seq + 1)), jnp.int32
    )
    tokens, targets = batch[0, :, :-1], batch[0, :, 1:]
    loss = functools.partial(step.loss_fn, loss_chunk=args.loss_chunk)

    train = sharding.jit(
        step.make_train_step(
            graphdef,
            optimizer=optimizer,
            grad_clip=1.0,
            param_shardings=p_sh,
            opt_shardings=o_sh,
            loss_chunk=args.loss_chunk,
        ),
        mesh=mesh,
        program="train",
        donate_argnums=(0, 1),
    )
    forward = sharding.jit(lambda p, t, y: loss(graphdef, p, t, y), mesh=mesh, program="train")
    grads_fn = sharding.jit(
        lambda p, t, y: step.loss_and_grads(graphdef, p, t, y, loss_chunk=args.loss_chunk),
        mesh=mesh,
        program="train",
    )

    def update(params, opt_state, grads):
        norm = sharding.global_norm(grads, p_sh)
        scale = jnp.minimum(1.0, 1.0 / jnp.maximum(norm, 1e-12))
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    update_fn = sharding.jit(update, mesh=mesh, program="train", donate_argnums=(0, 1))

    state = {"params": params, "opt": opt_state, "grads": None}

    def run(piece):
        if piece == "step":
            state["params"], state["opt"], m = train(state["params"], state["opt"], batch)
            return m["loss"]
        if piece == "forward":
            return forward(state["params"], tokens, targets)
        if piece == "grads":
            out = grads_fn(state["params"], tokens, targets)
            state["grads"] = out[1]
            return out[0]
        if state["grads"] is None:
            state["grads"] = grads_fn(state["params"], tokens, targets)[1]
        state["params"], state["opt"] = update_fn(state["params"], state["opt"], state["grads"])
        return state["params"]

    return _time(run, args)


def _time(run, args) -> dict:
    import gc

    times = {p: [] for p in args.pieces}
    cpu = {p: [] for p in args.pieces}
    for p in args.pieces:  # warm-up: compile and one call
        t = time.perf_counter()
        _block(run(p))
        print(f"# {p}: first call {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    for _ in range(args.rounds):
        for p in args.pieces:
            gc.collect()
            t, c = time.perf_counter(), _cpu()
            _block(run(p))
            times[p].append(time.perf_counter() - t)
            cpu[p].append(_cpu() - c)
    ms = lambda v: [round(1e3 * x, 1) for x in v]  # noqa: E731
    return {p: ms(v) for p, v in times.items()}, {p: ms(v) for p, v in cpu.items()}


def _cpu() -> float:
    """CPU seconds this process has used (every thread, user and system)."""
    t = os.times()
    return t.user + t.system


def _block(x):
    if hasattr(x, "block_until_ready"):
        x.block_until_ready()
    else:
        import jax

        jax.block_until_ready(x)


def hf_profile(args) -> dict:
    import _hf
    import torch

    fields = _hf.llama_fields_apart("smollm2")
    model = _hf.llama(fields, threads=args.threads).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1
    )
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, fields["vocab_size"], (args.batch, args.seq + 1), generator=gen)
    tokens, targets = batch[:, :-1], batch[:, 1:]
    state = {}

    def loss_of():
        logits = model(input_ids=tokens).logits
        return torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    def run(piece):
        if piece == "forward":
            with torch.no_grad():
                return loss_of().item()
        if piece == "grads":
            opt.zero_grad(set_to_none=True)
            loss = loss_of()
            loss.backward()
            state["g"] = True
            return loss.item()
        if piece == "update":
            if "g" not in state:
                run("grads")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return None
        opt.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    return _time(run, args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--loss-chunk", type=int, default=64)
    ap.add_argument("--remat", default="matmuls", choices=("none", "module", "matmuls"))
    ap.add_argument(
        "--policy",
        default=None,
        help="remat=matmuls with this jax.checkpoint_policies name instead (experiments)",
    )
    ap.add_argument("--pieces", nargs="+", default=list(PIECES), choices=PIECES)
    ap.add_argument("--hf", action="store_true", help="transformers' step instead")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    times, cpu = hf_profile(args) if args.hf else jax_profile(args)
    tokens = args.batch * args.seq
    who = "transformers" if args.hf else f"ladder_jax remat={args.remat}"
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    for p, v in times.items():
        med = statistics.median(v)
        extra = f"  {tokens / med * 1e3:6.1f} tokens/s" if p == "step" else ""
        print(
            f"{who:<28} {p:<8} median {med:8.1f} ms  ({', '.join(map(str, v))}){extra}"
            f"  CPU {statistics.median(cpu[p]):8.1f} ms"
        )
    print(json.dumps({"who": who, "load": load, "ms": times, "cpu_ms": cpu}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    raise SystemExit(main())
