"""How much of the ladder's gain the performance model's own schedule allows, per precision:
each module's compute C and all-reduce A from the compiled standard decode step, the best any
schedule that hides module i's all-reduce behind module i + 1 only could do, and the ladder's
predicted decode step against it (deviceless H100 compiles; no GPU needed).

    python benchmarks/ladder_bound.py --preset llama-3-8b --tp 8 --batch 1 16 --quantize none int8

One line per (precision, batch): microseconds per layer of attention's and the MLP's compute
(`perfmodel.costed`: roofline time plus fixed overhead, alone on the GPU) and of their
all-reduces; the standard step's layer (C + A); the best layer (`perfmodel.overlap_bound`:
sum of max(C[i + 1], A[i])) and its bound on ladder/standard, then that bound where each
cross-stream handover costs the calibration's `stream_sync_s` as the ladder's asynchronous
all-reduces do (`waited`); the ladder's predicted decode step over the standard's
(`perfmodel.program_time`, per token as `predict` costs it) and its exposed all-reduce per
layer against the best's (without waits). All in microseconds per layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax


def bound_row(cfg, *, tp: int, batch: int, prompt_len: int, new_tokens: int, target: str) -> dict:
    """The fields of one line (module docstring), in seconds per layer."""
    from ladder_jax import hardware
    from ladder_jax.analysis import perfmodel

    cal = hardware.calibration(target)
    link = hardware.links(target)["nvlink"]
    shape = dict(tp=tp, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, target=target)
    depth = 4
    std = dataclasses.replace(cfg, residual="standard")
    kernels = perfmodel.program_kernels(
        dataclasses.replace(std, n_layers=depth), phase="decode", **shape
    ).kernels
    ops = perfmodel.costed(kernels, calibration=cal, link=link, launch="graphs")
    ops = perfmodel.stream_waits(ops, cal.launch.stream_sync_s)
    m = perfmodel.module_times(ops, layer=depth - 2)  # a layer with layers on both sides
    b = perfmodel.overlap_bound(m["compute_s"], m["collective_s"])
    waited = perfmodel.overlap_bound(
        m["compute_s"], m["collective_s"], wait_s=cal.launch.stream_sync_s
    )
    steps = {
        r: perfmodel.program_time(
            dataclasses.replace(cfg, residual=r), phase="decode", link=link, **shape
        )
        for r in ("standard", "ladder")
    }
    n = cfg.n_layers
    return {
        "compute_s": m["compute_s"],
        "collective_s": m["collective_s"],
        **b,
        "best_waited_s": waited["best_s"],
        "bound_waited": waited["bound"],
        "standard_step_s": steps["standard"]["seconds"],
        "ladder_step_s": steps["ladder"]["seconds"],
        "ladder_vs_standard": steps["standard"]["seconds"] / steps["ladder"]["seconds"],
        "ladder_exposed_per_layer_s": steps["ladder"]["exposed_comm_s"] / n,
        "standard_exposed_per_layer_s": steps["standard"]["exposed_comm_s"] / n,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--tp", type=int, nargs="+", default=[8])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--quantize", nargs="+", default=["none", "int8"], help="none and/or int8")
    p.add_argument("--decode-matmul", default="pallas", help="xla or pallas")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--target", default="h100")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")

    from ladder_jax.config import ModelConfig

    us = 1e6
    if not args.json:
        print(
            f"{'quant':<5} {'tp':>3} {'batch':>5} {'C attn':>7} {'C mlp':>7} {'A attn':>7} "
            f"{'A mlp':>7} {'serial':>7} {'best':>7} {'bound':>6} {'waited':>6} {'ladder':>6} "
            f"{'exp lad':>7} {'exp best':>8}"
        )
    for q in args.quantize:
        for tp in args.tp:
            for b in args.batch:
                cfg = ModelConfig.from_preset(
                    args.preset,
                    quantize=None if q == "none" else q,
                    decode_matmul=args.decode_matmul,
                )
                r = bound_row(
                    cfg,
                    tp=tp,
                    batch=b,
                    prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens,
                    target=args.target,
                )
                if args.json:
                    print(json.dumps({"quantize": q, "tp": tp, "batch": b, **r}))
                    continue
                (ca, cm), (aa, am) = r["compute_s"], r["collective_s"]
                print(
                    f"{q:<5} {tp:>3} {b:>5} {ca * us:>7.2f} {cm * us:>7.2f} {aa * us:>7.2f} "
                    f"{am * us:>7.2f} {r['serial_s'] * us:>7.2f} {r['best_s'] * us:>7.2f} "
                    f"{r['bound']:>6.3f} {r['bound_waited']:>6.3f} "
                    f"{r['ladder_vs_standard']:>6.3f} "
                    f"{r['ladder_exposed_per_layer_s'] * us:>7.2f} "
                    f"{r['best_exposed_s'] * us:>8.2f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
