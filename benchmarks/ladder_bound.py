"""How much of the ladder's gain the performance model's own schedule allows, per precision,
and how much of it the order XLA compiles leaves: each module's compute C and all-reduce A
from the compiled standard decode step, the best any schedule that hides module i's
all-reduce behind module i + 1 only could do, the best under XLA:GPU's rule that two
collectives over the same GPUs are never in flight together, and the ladder's compiled
decode step against them (deviceless H100 compiles; no GPU needed).

    python benchmarks/ladder_bound.py --preset llama-3-8b --tp 8 --batch 1 16 --quantize none int8
    python benchmarks/ladder_bound.py --quantize int8 --batch 1 --timeline

One line per (precision, batch): microseconds per layer of attention's and the MLP's compute
(`timeline.costed`: roofline time plus fixed overhead, alone on the GPU) and of their
all-reduces, the standard layer (C + A, `serial`), then ladder / standard, each the
standard's figure over the ladder's:
- `bound`: the best layer any schedule could reach (`timeline.overlap_bound`), handovers
  between the compute and the collective stream free;
- `waits`: the same, each handover costing the calibration's `stream_sync_s` as the ladder's
  asynchronous all-reduces do;
- `xla`: the best with those waits where one all-reduce is in flight at a time
  (`overlap_bound(..., one_in_flight=True)`: kernels j, done j - 1, start j);
- `layer`: the layer of the compiled ladder and standard steps as the model replays them
  (`timeline.simulate` of 4 layers less 3, contention and launches included);
- `step`: the whole decode step (`perfmodel.program_time`: the head too, at full depth);
- `predict`: tokens/s as `predict` costs a generation (the prefill and new_tokens - 1 steps).
`--timeline` prints, after each line, the ladder's compiled layer as the model replays it:
every kernel and all-reduce that begins from the layer's first op to the next layer's, with
its start and end in microseconds from the first (`simulate(..., trace=...)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax

DEPTH = 4  # layers compiled; the layer measured is DEPTH - 2, with layers on both sides


def layer_replay(cfg, *, residual: str, shape, cal, link) -> tuple[float, list]:
    """(seconds of one layer, its spans) of the compiled decode step with `residual`, replayed
    as `program_time` replays it: DEPTH layers less DEPTH - 1, and the spans that begin from
    layer DEPTH - 2's first op to layer DEPTH - 1's."""
    from ladder_jax.analysis import compiled, timeline

    seconds, trace = [], []
    for depth in (DEPTH - 1, DEPTH):
        kernels = compiled.program_kernels(
            dataclasses.replace(cfg, residual=residual, n_layers=depth), shape, phase="decode"
        ).kernels
        ops = timeline.costed(kernels, calibration=cal, link=link, launch="graphs")
        ops = timeline.stream_waits(ops, cal.launch.stream_sync_s)
        trace = []
        t = timeline.simulate(
            ops, step_s=cal.launch.step_s, copy_rate=cal.contention.copy_rate, trace=trace
        )
        seconds.append(t.seconds)
    # the layer's window: from its first op to the next layer's (ops XLA names no layer for
    # included)
    t0 = min(s.start for s in trace if s.layer == DEPTH - 2)
    t1 = min(s.start for s in trace if s.layer == DEPTH - 1)
    return seconds[1] - seconds[0], [s for s in trace if t0 <= s.start < t1]


def bound_row(cfg, *, tp: int, batch: int, prompt_len: int, new_tokens: int, target: str) -> dict:
    """The fields of one line (module docstring), in seconds per layer, and the ladder's
    layer timeline (`ladder_spans`)."""
    from ladder_jax import hardware
    from ladder_jax.analysis import compiled, perfmodel, timeline

    cal = hardware.calibration(target)
    link = hardware.links(target)["nvlink"]
    shape = compiled.Workload(tp, batch, prompt_len, new_tokens, target=target)
    std = dataclasses.replace(cfg, residual="standard")
    kernels = compiled.program_kernels(
        dataclasses.replace(std, n_layers=DEPTH), shape, phase="decode"
    ).kernels
    ops = timeline.costed(kernels, calibration=cal, link=link, launch="graphs")
    m = timeline.module_times(ops, layer=DEPTH - 2)
    wait = cal.launch.stream_sync_s
    b = timeline.overlap_bound(m["compute_s"], m["collective_s"])
    waited = timeline.overlap_bound(m["compute_s"], m["collective_s"], wait_s=wait)
    xla = timeline.overlap_bound(m["compute_s"], m["collective_s"], wait_s=wait, one_in_flight=True)
    layers, spans, steps, gens = {}, [], {}, {}
    for r in ("standard", "ladder"):
        layers[r], trace = layer_replay(cfg, residual=r, shape=shape, cal=cal, link=link)
        if r == "ladder":
            spans = trace
        c = dataclasses.replace(cfg, residual=r)
        steps[r] = perfmodel.program_time(c, shape, perfmodel.Costing(link), phase="decode")
        pre = perfmodel.program_time(c, shape, perfmodel.Costing(link), phase="prefill")
        gens[r] = pre["seconds"] + (new_tokens - 1) * steps[r]["seconds"]
    n = cfg.n_layers
    return {
        "compute_s": m["compute_s"],
        "collective_s": m["collective_s"],
        **b,
        "best_waited_s": waited["best_s"],
        "bound_waited": waited["bound"],
        "best_one_in_flight_s": xla["best_s"],
        "bound_one_in_flight": xla["bound"],
        "standard_layer_s": layers["standard"],
        "ladder_layer_s": layers["ladder"],
        "layer_vs_standard": layers["standard"] / layers["ladder"],
        "standard_step_s": steps["standard"]["seconds"],
        "ladder_step_s": steps["ladder"]["seconds"],
        "ladder_vs_standard": steps["standard"]["seconds"] / steps["ladder"]["seconds"],
        "predict_vs_standard": gens["standard"] / gens["ladder"],
        "ladder_exposed_per_layer_s": steps["ladder"]["exposed_comm_s"] / n,
        "standard_exposed_per_layer_s": steps["standard"]["exposed_comm_s"] / n,
        "ladder_spans": [dataclasses.asdict(s) for s in spans],
    }


def format_timeline(spans: list[dict]) -> str:
    """The spans of a layer, by start, in microseconds from the first: start, end, length,
    stream, name."""
    if not spans:
        return "  (no spans)"
    spans = sorted(spans, key=lambda s: (s["start"], s["stream"] != "kernel"))
    t0, us = spans[0]["start"], 1e6
    lines = [f"  {'start':>7} {'end':>7} {'us':>6}  stream      name"]
    for s in spans:
        lines.append(
            f"  {(s['start'] - t0) * us:>7.2f} {(s['end'] - t0) * us:>7.2f} "
            f"{(s['end'] - s['start']) * us:>6.2f}  {s['stream']:<10}  {s['name']}"
        )
    return "\n".join(lines)


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
    p.add_argument("--timeline", action="store_true", help="the ladder's layer, op by op")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")

    from ladder_jax.config import ModelConfig

    us = 1e6
    if not args.json:
        print(
            f"{'quant':<5} {'tp':>3} {'batch':>5} {'C attn':>7} {'C mlp':>7} {'A attn':>7} "
            f"{'A mlp':>7} {'serial':>7} {'bound':>6} {'waits':>6} {'xla':>6} {'layer':>6} "
            f"{'step':>6} {'predict':>7}"
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
                spans = r.pop("ladder_spans")
                if args.json:
                    extra = {"ladder_spans": spans} if args.timeline else {}
                    print(json.dumps({"quantize": q, "tp": tp, "batch": b, **r, **extra}))
                    continue
                (ca, cm), (aa, am) = r["compute_s"][:2], r["collective_s"][:2]
                print(
                    f"{q:<5} {tp:>3} {b:>5} {ca * us:>7.2f} {cm * us:>7.2f} {aa * us:>7.2f} "
                    f"{am * us:>7.2f} {r['serial_s'] * us:>7.2f} {r['bound']:>6.3f} "
                    f"{r['bound_waited']:>6.3f} {r['bound_one_in_flight']:>6.3f} "
                    f"{r['layer_vs_standard']:>6.3f} {r['ladder_vs_standard']:>6.3f} "
                    f"{r['predict_vs_standard']:>7.3f}",
                    flush=True,
                )
                if args.timeline:
                    print(format_timeline(spans), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
