"""The predicted tables of `python -m ladder_jax.predict` for the paper's settings, each with the
command that reproduces it and its wall time (compiles are cached: a rerun takes seconds).

    python benchmarks/predict_tables.py                 # every table, in order
    python benchmarks/predict_tables.py 70b-grid a100   # some of them
    python benchmarks/predict_tables.py --list
    python benchmarks/predict_tables.py --jobs 2        # two programs compiling at a time
    python benchmarks/predict_tables.py --split presets # prefill / decode, with and without waits
    python benchmarks/predict_tables.py presets --no-nccl-in-host  # an ablation's table

Tables (prompt 1024, 512 new tokens, all four schemes):
- 70b-grid: llama-3-70b on H100, TP 2/4/8 x batch 1/4/8/16/32/64 x NVLink / PCIe
- presets: 1b, 3b, llama-3-8b, llama-3-70b on H100 at TP 8, batch 4, NVLink / PCIe
- 405b: llama-3.1-405b, TP 16 over 2 hosts (IB NDR), batch 1/4/8/16, NVLink / PCIe (P2P off)
- a100: llama-2-7b at TP 1/2/4/8 and llama-2-70b at TP 2/4/8 on A100, batch 1, NVLink / PCIe
- a100-40gb: llama-2-7b at TP 1/2/4/8 on the 40 GB A100 (slower HBM), batch 1, NVLink / PCIe
Each prints markdown: one row per (link, tp, batch), tokens/s of standard and each scheme's
ratio to it; under it, a note for every scheme predicted above upper_bound (what its compiled
programs do less of, or a costing defect). `--split`: instead, each scheme's prefill and
decode-step speed-up over standard, with the cross-stream waits and without them
(`--no-stream-sync`), as "with -> without". `--no-nccl-in-host` / `--no-nvls` / `--no-waves`: the
tables under that ablation (`python -m ladder_jax.predict --help`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TABLES = {
    "70b-grid": [dict(preset="llama-3-70b", tp=[2, 4, 8], batch=[1, 4, 8, 16, 32, 64])],
    "presets": [
        dict(preset=p, tp=[8], batch=[4]) for p in ("1b", "3b", "llama-3-8b", "llama-3-70b")
    ],
    "405b": [dict(preset="llama-3.1-405b", tp=[16], batch=[1, 4, 8, 16])],
    "a100": [
        dict(preset="llama-2-7b", tp=[1, 2, 4, 8], batch=[1], target="a100"),
        dict(preset="llama-2-70b", tp=[2, 4, 8], batch=[1], target="a100"),
    ],
    "a100-40gb": [dict(preset="llama-2-7b", tp=[1, 2, 4, 8], batch=[1], target="a100-40gb")],
}


def command(spec: dict, flags: str = "") -> str:
    return (
        f"python -m ladder_jax.predict --preset {spec['preset']} --tp "
        f"{' '.join(map(str, spec['tp']))} --batch {' '.join(map(str, spec['batch']))} "
        f"--link nvlink pcie --target {spec.get('target', 'h100')} --json{flags}"
    )


def markdown(rows: list[dict]) -> str:
    schemes = [
        s
        for s in ("standard", "parallel", "ladder", "upper_bound")
        if any(r["residual"] == s for r in rows)
    ]
    head = (
        "| preset | link | tp | hosts | batch | standard tok/s | "
        + " | ".join(f"{s}/std" for s in schemes if s != "standard")
        + " |"
    )
    out = [head, "|" + "---|" * (5 + len(schemes))]
    cells = {}
    for r in rows:
        cells.setdefault((r["preset"], r["link"], r["tp"], r["hosts"], r["batch"]), {})[
            r["residual"]
        ] = r
    for (preset, link, tp, hosts, batch), by in cells.items():
        std = by.get("standard")
        ratios = [
            f"{by[s]['vs_standard']:.3f}" if s in by and by[s]["vs_standard"] else "-"
            for s in schemes
            if s != "standard"
        ]
        fb = " (cuBLAS GEMMs)" if any(r.get("fallback") for r in by.values()) else ""
        out.append(
            f"| {preset}{fb} | {link} | {tp} | {hosts} | {batch} | "
            f"{std['tokens_per_s']:.1f} | " + " | ".join(ratios) + " |"
        )
    notes = []  # a scheme faster than upper_bound: what its programs do less of, or a defect
    for r in rows:
        note = r.get("above_upper_bound")
        if note and f"- {r['preset']}: {note}" not in notes:
            notes.append(f"- {r['preset']}: {note}")
    return "\n".join(out + ([""] + notes if notes else []))


def split_markdown(waits: list[dict], none: list[dict]) -> str:
    """The prefill / decode split of two runs of the same table, with the cross-stream waits
    (`waits`) and without (`none`): standard's prefill ms, then each scheme's speed-up over
    standard (standard's seconds over its own) in prefill and in the decode step."""
    key = lambda r: (r["preset"], r["link"], r["tp"], r["hosts"], r["batch"])  # noqa: E731
    run = {(key(r), r["residual"], w): r for w, rows in ((1, waits), (0, none)) for r in rows}
    schemes = [s for s in ("parallel", "ladder", "upper_bound") if any(k[1] == s for k in run)]
    cols = [f"{s}/std {p}" for p in ("prefill", "decode") for s in schemes]
    out = [
        "| preset | link | tp | hosts | batch | standard prefill ms | " + " | ".join(cols) + " |",
        "|" + "---|" * (6 + len(cols)),
    ]
    for k in dict.fromkeys(key(r) for r in waits):
        cells = []
        for field in ("prefill_s", "decode_step_s"):
            for s in schemes:
                gain = [run[(k, "standard", w)][field] / run[(k, s, w)][field] for w in (1, 0)]
                cells.append(f"{gain[0]:.3f} -> {gain[1]:.3f}")
        std = run[(k, "standard", 1)]["prefill_s"] * 1e3
        out.append("| " + " | ".join(map(str, k)) + f" | {std:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tables", nargs="*", help=f"some of: {', '.join(TABLES)} (default: all)")
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    ap.add_argument("--layers-compiled", type=int, default=4)
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="programs compiled at once (threads; 2 gains ~15%% on 2 cores)",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="prefill and decode-step speed-ups, with -> without the cross-stream waits",
    )
    ap.add_argument(
        "--no-nccl-in-host",
        action="store_true",
        help="collectives within a host as a ring at LL's latency (the ablation)",
    )
    ap.add_argument("--no-nvls", action="store_true", help="no NVLink SHARP within a host")
    ap.add_argument(
        "--no-waves",
        action="store_true",
        help="GEMMs beside a collective slowed by the SM share, not by waves (the ablation)",
    )
    args = ap.parse_args(argv)
    flags = "".join(
        f" --{f}"
        for f in ("no-nccl-in-host", "no-nvls", "no-waves")
        if getattr(args, f.replace("-", "_"))
    )
    names = args.tables or list(TABLES)
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        print(
            f"error: unknown table {unknown[0]!r}: choose from {', '.join(TABLES)}", file=sys.stderr
        )
        return 2
    if args.list:
        for n in names:
            for spec in TABLES[n]:
                print(f"{n}: {command(spec, flags)}")
        return 0

    import jax

    import ladder_jax as lj
    from ladder_jax.cli.predict import _Progress

    jax.config.update("jax_platforms", "cpu")
    for n in names:
        runs, t0 = {}, time.perf_counter()
        for sync in (True, False) if args.split else (True,):
            runs[sync] = []
            for spec in TABLES[n]:
                runs[sync] += lj.predict(
                    spec["preset"],
                    tp=spec["tp"],
                    batch=spec["batch"],
                    links=("nvlink", "pcie"),
                    target=spec.get("target", "h100"),
                    layers_compiled=args.layers_compiled,
                    jobs=args.jobs,
                    progress=_Progress(f"{n}: {spec['preset']}"),
                    stream_sync=sync,
                    nccl_in_host=not args.no_nccl_in_host,
                    nvls=not args.no_nvls,
                    waves=not args.no_waves,
                )
        wall = time.perf_counter() - t0
        print(
            f"\n### {n} ({wall:.0f} s wall, load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())})\n"
        )
        for spec in TABLES[n]:
            print(f"    {command(spec, flags)}")
            if args.split:
                print(f"    {command(spec, flags)} --no-stream-sync")
        print()
        table = split_markdown(runs[True], runs[False]) if args.split else markdown(runs[True])
        print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
