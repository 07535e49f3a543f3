"""The adaptation experiment's report: the claims it tests (paired differences, their
standard errors, the verdicts), the markdown table and the plots, from its result rows
(`ladder_jax.experiments.adaptation.run`).

    rows = claims(results); print(table(results)); plots(results, out)"""

from __future__ import annotations

import math
import os

import numpy as np
from matplotlib.figure import Figure

from ladder_jax.experiments.paper_quality import PAPER, smooth, verdict


def mean_se(values) -> tuple[float, float]:
    v = np.asarray(values, float)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0


def held_out_mean(row) -> tuple[float, float]:
    """Mean held-out loss over the sources, and its standard error."""
    h = row["held_out"].values()
    return (
        float(np.mean([v["loss"] for v in h])),
        math.sqrt(sum(v["se"] ** 2 for v in h)) / len(h),
    )


def paired_se(a, b, *, ddof: int) -> float:
    """Standard error of the mean of the differences a_i - b_i of two models' outcomes on the
    same items (sd of the differences / sqrt(n), `ddof` as in `np.std`).

        paired_se([1, 1, 0, 1], [1, 0, 0, 1], ddof=0)   # sqrt(3 / 16) / 2

    What the two share cancels: identical outcomes give 0 whatever their own spread."""
    d = np.asarray(a, float) - np.asarray(b, float)
    return float(d.std(ddof=ddof) / math.sqrt(len(d))) if len(d) > ddof else 0.0


def _acc_diff(x: dict, y: dict) -> tuple[float, float, bool]:
    """(x's average accuracy minus y's in points, its standard error, paired): paired over
    the documents when both rows keep the per-document outcomes of the same subsample (the
    binomial convention, ddof 0), else the two standard errors combined."""
    d, per = 100 * (x["avg"] - y["avg"]), []
    tasks, other = x.get("tasks") or {}, y.get("tasks") or {}
    for t, v in tasks.items() if tasks.keys() == other.keys() else ():
        a, b = v.get("correct"), other[t].get("correct")
        if a is None or b is None or len(a) != len(b) or len(a) != v["docs"]:
            return d, 100 * math.hypot(x["avg_se"], y["avg_se"]), False
        per.append(paired_se(a, b, ddof=0))
    if not per:
        return d, 100 * math.hypot(x["avg_se"], y["avg_se"]), False
    return d, 100 * math.sqrt(sum(e * e for e in per)) / len(per), True


def loss_diff(x: dict, y: dict) -> tuple[float, float, bool]:
    """(x's mean held-out loss minus y's in nats, its standard error, paired): paired over
    the records (the same records of each source, ddof 1 as `mean_se`) when both rows keep
    them, else the two standard errors combined."""
    (lx, sx), (ly, sy) = held_out_mean(x), held_out_mean(y)
    per = []
    for src, v in x["held_out"].items():
        a, b = v.get("records"), y["held_out"].get(src, {}).get("records")
        if a is None or b is None or len(a) != len(b) or len(a) < 2:
            return lx - ly, math.hypot(sx, sy), False
        per.append(paired_se(a, b, ddof=1))
    return lx - ly, math.sqrt(sum(e * e for e in per)) / len(per), True


def _pm(d: float, margin: float, paired: bool, fmt: str) -> str:
    """The text (+d ± margin), marked when the margin is the unpaired one."""
    return f"({d:+{fmt}} ± {margin:{fmt}}{'' if paired else ', unpaired'})"


def _better(x: dict, y: dict) -> tuple[float, float, str]:
    """(how much better model row x is than y, 2 standard errors of that difference, the
    figure as text): the average accuracy in points when both have one, else the mean
    held-out loss (nats, lower is better); paired where the rows allow (`_acc_diff`)."""
    if x["avg"] is not None and y["avg"] is not None:
        d, se, paired = _acc_diff(x, y)
        m = 2 * se
        return (
            d,
            m,
            f"average {100 * y['avg']:.1f} -> {100 * x['avg']:.1f} {_pm(d, m, paired, '.1f')}",
        )
    d, se, paired = loss_diff(x, y)
    ly = held_out_mean(y)[0]
    m = 2 * se
    return -d, m, f"held-out loss {ly:.3f} -> {ly + d:.3f} {_pm(d, m, paired, '.3f')} nats"


def claims(results: list[dict]) -> list[dict]:
    """The paper's adaptation claims beside what was measured; "reproduces" is
    `paper_quality.verdict` with a margin of 2 standard errors of the difference (of the
    accuracies when the rows have them, else of the held-out losses), paired over the same
    documents / records where the rows keep per-item outcomes (`_acc_diff`, `loss_diff`;
    "unpaired" in the text otherwise), never "yes" inside it."""
    models = [r for r in results if r["kind"] == "model"]
    orig = next((r for r in models if r["stage"] == "original"), None)
    if orig is None:
        return []
    a, out = PAPER["adapt"], []

    def claim(name, paper, measured, holds):
        out.append(
            {
                "kind": "claim",
                "claim": name,
                "paper": paper,
                "measured": measured,
                "reproduces": holds,
            }
        )

    zs = sorted((r for r in models if r["stage"] == "zero-shot"), key=lambda r: r["ladder_layers"])
    n = orig["n_layers"]
    for r in zs:
        d, m, _ = _better(orig, r)
        claim(
            f"converting the upper {r['ladder_layers']} of {n} zero-shot hurts",
            f"average {a['original']} -> {a['16/32 zero-shot']} (upper 16 of 32)",
            f"original -> converted: {_better(r, orig)[2]}"
            + (f"; {_loss_text(orig, r)}" if r["avg"] is not None else ""),
            verdict(d, m),
        )
    if len(zs) > 1:
        d, m, _ = _better(zs[0], zs[-1])
        claim(
            "more converted layers hurt more (zero-shot)",
            f"20/32 retrained {a['20/32 retrained']} below 16/32's ~{a['16/32 retrained']}",
            f"upper {zs[0]['ladder_layers']} -> upper {zs[-1]['ladder_layers']}: "
            f"{_better(zs[-1], zs[0])[2]}",
            verdict(d, m),
        )
    ctl = {r["method"]: r for r in models if r["stage"] == "control"}
    rec = {r["method"]: r for r in models if r["stage"] == "recovered"}
    for method, r in rec.items():
        z = next((x for x in zs if x["ladder_layers"] == r["ladder_layers"]), None)
        gap, m_gap, _ = _better(orig, r)
        up = _better(r, z) if z else None
        holds = "no" if gap > m_gap else verdict(up[0], up[1]) if up else "inconclusive"
        c = ctl.get(method)
        claim(
            f"recovery ({method}, {r['tokens']:,} tokens) brings it back",
            f"{a['retrain_tokens']} tokens: back to ~{a['16/32 retrained']} (original "
            f"{a['original']})",
            f"upper {r['ladder_layers']}, zero-shot -> recovered: "
            f"{up[2] if up else '-'}; original -> recovered: {_better(r, orig)[2]}"
            + (f"; control (unconverted, recovered alike): {_better(c, orig)[2]}" if c else ""),
            holds,
        )
    if "lm" in rec and "distill" in rec:
        lm, ds = held_out_mean(rec["lm"])[0], held_out_mean(rec["distill"])[0]
        d, se, paired = loss_diff(rec["distill"], rec["lm"])
        m = 2 * se
        claim(
            "distillation recovers more per token than LM fine-tuning (the issue's question)",
            "-",
            f"held-out loss distill {ds:.3f} vs LM {lm:.3f} {_pm(d, m, paired, '.3f')}"
            + (
                f"; average {_pct(rec['distill'])} vs {_pct(rec['lm'])}"
                if rec["lm"]["avg"] is not None
                else ""
            ),
            verdict(-d, m),
        )
    return out


def _loss_text(x: dict, y: dict) -> str:
    d, se, paired = loss_diff(y, x)
    lx = held_out_mean(x)[0]
    return f"held-out loss {lx:.3f} -> {lx + d:.3f} {_pm(d, 2 * se, paired, '.3f')}"


def _pct(row) -> str:
    return f"{100 * row['avg']:.1f}" if row and row["avg"] is not None else "-"


def table(results: list[dict]) -> str:
    """Markdown: one row per model (accuracy per task, average, held-out loss), the claims."""
    models = [r for r in results if r["kind"] == "model"]
    if not models:
        return ""
    tasks = list(models[0]["tasks"])
    srcs = list(models[0]["held_out"])
    head = ["model", *tasks, "average", *(f"loss {s}" for s in srcs)]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    setup = next((r for r in results if r["kind"] == "setup"), {})
    if setup.get("setting") == "quick":
        lines[:0] = [
            "The quick setting checks the pipeline, not the claim: a few recovery steps and "
            "a few documents, so the verdicts below say nothing about the paper.",
            "",
        ]
    for r in models:
        accs = [
            f"{100 * r['tasks'][t]['acc']:.1f} ± {100 * r['tasks'][t]['se']:.1f}" for t in tasks
        ]
        loss = [f"{r['held_out'][s]['loss']:.3f} ± {r['held_out'][s]['se']:.3f}" for s in srcs]
        avg = f"{100 * r['avg']:.1f} ± {100 * r['avg_se']:.1f}" if tasks else "-"
        lines.append("| " + " | ".join([r["name"], *accs, avg, *loss]) + " |")
    cl = [r for r in results if r["kind"] == "claim"]
    if cl:
        lines += [
            "",
            "| the paper's claim | paper (Llama-3.1-8B) | measured here | reproduces |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['claim']} | {r['paper']} | {r['measured']} | {r['reproduces']} |" for r in cl
        ]
    chats = [(r["name"], r["chat"]) for r in models]
    lines += [
        "",
        "| model | " + " | ".join(chats[0][1]) + " |",
        "|---" * (1 + len(chats[0][1])) + "|",
    ]
    for name, c in chats:
        cells = [" ".join(a.split())[:60].replace("|", "/") or "(nothing)" for a in c.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(results: list[dict], out: str) -> list[str]:
    """recovery.png (training loss per recovery run) and tasks.png (accuracy per task and
    model, with standard errors). Returns the paths."""
    models = [r for r in results if r["kind"] == "model"]
    runs = [r for r in models if r.get("curve")]
    paths = []
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for r in runs:
        k = max(1, len(r["curve"]) // 10)
        y = smooth(r["curve"], k)
        ax.plot(
            np.arange(len(y)) + k,
            y,
            label=r["name"],
            linestyle="-" if r["stage"] == "recovered" else "--",
        )
    ax.set(
        xlabel="step",
        ylabel="training loss (the method's own)",
        title="Recovery: LM loss (nats/token) or KL to the original",
    )
    if runs:
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "recovery.png"))
    fig.savefig(paths[-1], dpi=100)

    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    if models and not models[0]["tasks"]:  # no accuracies: held-out loss per source
        groups = list(models[0]["held_out"])
        bars = [
            ([r["held_out"][x]["loss"] for x in groups], [r["held_out"][x]["se"] for x in groups])
            for r in models
        ]
        labels = ("held-out loss, nats/token (± s.e.)", "Held-out text per source")
    else:
        groups = list(models[0]["tasks"]) + ["average"] if models else []
        bars = [
            (
                [100 * r["tasks"][t]["acc"] for t in groups[:-1]] + [100 * r["avg"]],
                [100 * r["tasks"][t]["se"] for t in groups[:-1]] + [100 * r["avg_se"]],
            )
            for r in models
        ]
        labels = ("accuracy % (± standard error)", "OLMES tasks, zero-shot and recovered")
    w = 0.8 / max(1, len(models))
    for j, (r, (y, e)) in enumerate(zip(models, bars)):
        ax.bar(np.arange(len(groups)) + j * w, y, w, yerr=e, capsize=2, label=r["name"])
    ax.set_xticks(np.arange(len(groups)) + w * (len(models) - 1) / 2, groups)
    ax.set(ylabel=labels[0], title=labels[1])
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out, "tasks.png"))
    fig.savefig(paths[-1], dpi=100)
    return paths
