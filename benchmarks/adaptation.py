"""The paper's adaptation claim on SmolLM2-135M-Instruct: its upper layers made ladder layers,
zero-shot and after recovery (LM fine-tuning vs distillation from the original, the
unconverted model recovered alike as the control), on the OLMES tasks, held-out text and
greedy chat. Prints the Markdown tables on stdout (progress and the trainer's lines go to
stderr; --json: one JSON line per result instead), and writes results.json, recovery.png and
tasks.png under --out.

    python benchmarks/adaptation.py --quick          # the pipeline on SmolLM2, a few minutes
    python benchmarks/adaptation.py                  # upper 8/15/20 of 30, the six tasks
    python benchmarks/adaptation.py --set ladder_layers=[15] --set steps=8 --set eval_limit=20
    python benchmarks/adaptation.py --report --out runs/adaptation/full    # tables, plots

The experiment is `ladder_jax.experiments.adaptation` (its docstring says what each result
means); rerunning reuses the converted base, the generated text and finished recovery runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _report(path: str, ad) -> list[dict]:
    """The result rows of `path` with the claims recomputed from its model rows by this
    version's code (paired margins); the file is rewritten (whole) only when they change. A
    file that is not this experiment's results is a ConfigError and is left as it is."""
    from ladder_jax import atomic
    from ladder_jax.config import ConfigError

    if not os.path.isfile(path):
        raise ConfigError(f"--report: no {path}: run the experiment first")
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--report: cannot read {path} ({e})") from None
    rows = results if isinstance(results, list) else []
    kinds = [r.get("kind") if isinstance(r, dict) else None for r in rows]
    if "model" not in kinds or not all(isinstance(k, str) for k in kinds):
        raise ConfigError(
            f"--report: {path} is not the results of this experiment (a JSON list of rows, "
            f'each with its "kind", the models\' among them): nothing is written'
        )
    try:
        claims = ad.claims(results)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ConfigError(
            f"--report: {path} has a damaged row ({type(e).__name__}: {e}): nothing is written"
        ) from None
    at = next((i for i, r in enumerate(results) if r["kind"] in ("claim", "done")), len(results))
    rest = [r for r in results[at:] if r["kind"] != "claim"]
    new = results[:at] + claims + rest
    if new != results:
        atomic.write_text(path, json.dumps(new, indent=1))
    return new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI-sized setting")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change a field of the setting (YAML value), e.g. steps=8",
    )
    ap.add_argument("--out", default=None, help="directory (default runs/adaptation/<setting>)")
    ap.add_argument(
        "--report",
        action="store_true",
        help="no work: tables and plots of --out's results.json (its claims recomputed)",
    )
    ap.add_argument(
        "--json", action="store_true", help="stdout: one JSON line per result instead of the tables"
    )
    args = ap.parse_args(argv)

    import ladder_jax as lj  # after argparse: --help needs no jax
    from ladder_jax.experiments import adaptation as ad

    try:
        from ladder_jax.experiments.paper_quality import parse_set

        changes = parse_set(args.set, "steps=8")
        setting = ad.with_changes(ad.SETTINGS["quick" if args.quick else "full"], **changes)
        out = args.out or os.path.join("runs", "adaptation", setting.name)
        emit = (
            (lambda r: print(json.dumps(r), flush=True))
            if args.json  # noqa: E731
            else None
        )
        if args.report:
            results = _report(os.path.join(out, "results.json"), ad)
            for r in results:
                if emit:
                    emit(r)
        else:
            ad.check_setting(setting)  # task names before minutes of work
            if args.quick:
                # freed memory back to the kernel (ladder_jax.runtime.keep_freed_memory): the
                # quick setting runs each program a few times, so keeping it would save little
                # time and hold more memory at the trainer's peak
                os.environ.setdefault("LADDER_JAX_HOST_MALLOC", "default")
            lj.sharding.setup_host(1)
            results = ad.run(setting, out, emit=emit)
        paths = ad.plots(results, out)
    except lj.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(
            f"stopped ({str(e) or 'interrupted'}): run the same command again to resume",
            file=sys.stderr,
        )
        return 130
    if not args.json:
        print(ad.table(results), flush=True)
    print(f"wrote {os.path.join(out, 'results.json')}, {', '.join(paths)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
