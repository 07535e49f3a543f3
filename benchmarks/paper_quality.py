"""The paper's quality claims in miniature: from-scratch standard / parallel / ladder over seeds,
and a standard model's upper layers converted to ladder (zero-shot, then fine-tuned). Prints
the Markdown tables on stdout (progress and the trainer's lines go to stderr; --json: one JSON
line per result instead), and writes results.jsonl, curves.png and held_out.png under --out.

    python benchmarks/paper_quality.py --quick        # embedded corpus, 2 seeds: a few minutes
    python benchmarks/paper_quality.py                # King James Bible, 3 seeds (".[paper]")
    python benchmarks/paper_quality.py --quick --set steps=100 --set seeds=[0,1,2]
    python benchmarks/paper_quality.py --set seeds=[1] --no-adapt &    # seeds in parallel,
    python benchmarks/paper_quality.py                                 # then the rest

The experiment is `ladder_jax.experiments.paper_quality` (its docstring says what each result
means); rerunning reuses finished runs under --out unless --fresh.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI setting (embedded corpus)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change a field of the setting (YAML value), e.g. steps=100",
    )
    ap.add_argument("--out", default=None, help="directory (default runs/paper_quality/<setting>)")
    ap.add_argument("--fresh", action="store_true", help="retrain: remove the runs under --out")
    ap.add_argument(
        "--report",
        action="store_true",
        help="no training: table and plots of the finished runs under --out",
    )
    ap.add_argument(
        "--json",
        action="store_true",
        help="stdout: one JSON line per result, as results.jsonl holds them, instead of the tables",
    )
    ap.add_argument(
        "--no-adapt",
        action="store_true",
        help="from-scratch runs only (e.g. one process per seed sharing --out)",
    )
    args = ap.parse_args(argv)

    import ladder_jax as lj  # after argparse: --help needs no jax
    from ladder_jax.experiments import paper_quality as pq

    try:
        from ladder_jax.experiments.paper_quality import parse_set

        changes = parse_set(args.set, "steps=100")
        setting = pq.with_changes(pq.SETTINGS["quick" if args.quick else "full"], **changes)
        out = args.out or os.path.join("runs", "paper_quality", setting.name)
        emit = (
            (lambda r: print(json.dumps(r), flush=True))
            if args.json  # noqa: E731
            else None
        )
        if args.report:
            results = pq.collect(setting, out)
            for r in results:
                if emit:
                    emit(r)
            with open(os.path.join(out, "results.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in results)
        else:
            lj.sharding.setup_host(1)
            results = pq.run(setting, out, emit=emit, fresh=args.fresh, adapt=not args.no_adapt)
        paths = pq.plots(results, out)
    except lj.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(
            f"stopped ({e or 'interrupted'}): run the same command again to resume", file=sys.stderr
        )
        return 130
    if not args.json:
        print(pq.table(results), flush=True)
    print(f"wrote {os.path.join(out, 'results.jsonl')}, {', '.join(paths)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
