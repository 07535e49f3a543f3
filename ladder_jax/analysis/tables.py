"""The `predict` rows as text: the scheme table (ratios over standard; desync's rows named by
pattern), the training table, the memory note, the one-line summary and the decision table
(docs/analysis.md).

    print(format_table(rows)); print(summary(rows)); print(format_decision(decision(rows)))"""

from __future__ import annotations

from ladder_jax import hardware


def with_ratios(rows: list[dict]) -> list[dict]:
    """Adds `vs_standard`: tokens/s over the standard row of the same link, tp, batch and
    all-reduce implementation."""
    key = lambda r: (r["link"], r["tp"], r["batch"], r.get("allreduce"))  # noqa: E731
    std = {key(r): r["tokens_per_s"] for r in rows if r["residual"] == "standard"}
    return [
        {**r, "vs_standard": r["tokens_per_s"] / std[key(r)] if key(r) in std else None}
        for r in rows
    ]


def format_train_table(rows: list[dict]) -> str:
    lines = [
        f"{'link':<7} {'tp':>3} {'residual':<12} {'step ms':>10} {'exposed ms':>10} "
        f"{'tokens/s':>10} {'vs standard':>11}"
    ]
    for r in with_ratios(rows):
        ratio = "-" if r["vs_standard"] is None else f"{r['vs_standard']:.3f}x"
        lines.append(
            f"{r['link']:<7} {r['tp']:>3} {scheme_name(r):<12} {r['step_s'] * 1e3:>10.1f} "
            f"{r['exposed_comm_s'] * 1e3:>10.1f} {r['tokens_per_s']:>10.0f} {ratio:>11}"
        )
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'link':<7} {'tp':>3} {'batch':>5} {'residual':<12} {'prefill ms':>10} "
        f"{'decode ms/tok':>13} {'exposed ms/tok':>14} {'tokens/s':>10} "
        f"{'tok/s/user':>10} {'vs standard':>11} {'GiB/GPU':>7}"
    ]
    order = {name: i for i, name in enumerate(hardware.LINKS)}
    rows = sorted(with_ratios(rows), key=lambda r: (order.get(r["link"], 99), r["tp"], r["batch"]))
    for r in rows:
        ratio = "-" if r["vs_standard"] is None else f"{r['vs_standard']:.3f}x"
        mem = (
            ""
            if "memory_per_gpu_bytes" not in r
            else f" {r['memory_per_gpu_bytes'] / 2**30:>7.1f}"
            + ("" if r["fits"] else " does not fit")
        )
        name = scheme_name(r) + _implementation(r)
        lines.append(
            f"{r['link']:<7} {r['tp']:>3} {r['batch']:>5} {name:<12} "
            f"{r['prefill_s'] * 1e3:>10.1f} {r['decode_step_s'] * 1e3:>13.3f} "
            f"{r['decode_step_exposed_comm_s'] * 1e3:>14.3f} "
            f"{r['tokens_per_s']:>10.1f} {r['tokens_per_s_per_user']:>10.1f} "
            f"{ratio:>11}{mem}"
        )
    return "\n".join(lines)


def memory_note(rows: list[dict]) -> str:
    """What the GiB/GPU column counts, and what its flag means when a row has it."""
    first = next((r for r in rows if "device_pool_bytes" in r), None)
    if first is None:
        return ""
    chip, pool = hardware.CHIPS[first["target"]], first["device_pool_bytes"]
    note = (
        f"GiB/GPU: weights (input projections fused in place) + KV cache per GPU, "
        f"temporaries not counted; jax's pool on the {chip.name} is {pool / 2**30:.1f} GiB "
        f"({pool / chip.memory_bytes:.2f} of {chip.memory_bytes / 2**30:.1f} GiB: "
        f"XLA_PYTHON_CLIENT_MEM_FRACTION)"
    )
    if any(not r["fits"] for r in rows if "fits" in r):
        note += (
            "\ndoes not fit: more than the pool; more GPUs (--tp), a shorter cache, int8, "
            "or a larger XLA_PYTHON_CLIENT_MEM_FRACTION"
        )
    return note


def summary(rows: list[dict]) -> str:
    """ladder/standard and upper_bound/standard, one line per link, tp and batch."""
    out = []
    order = {name: i for i, name in enumerate(hardware.LINKS)}
    for r in sorted(with_ratios(rows), key=lambda r: order.get(r["link"], 99)):
        if r["residual"] in ("ladder", "upper_bound") and r["vs_standard"] is not None:
            name = f"{r['residual']}/standard{_implementation(r)}"
            out.append((r["link"], r["tp"], r["batch"], name, r["vs_standard"]))
    by = {}
    for link, tp, b, res, v in out:
        by.setdefault((link, tp, b), {})[res] = v
    return "\n".join(
        f"{link} tp={tp} batch={b}: " + ", ".join(f"{k} {v:.3f}" for k, v in d.items())
        for (link, tp, b), d in by.items()
    )


# desync's rows in the text table, by reduce pattern (`desync_note` says what each is)
DESYNC_NAMES = {
    "every_layer": "desync/1L",
    "every_2_layers": "desync/2L",
    "final_only": "desync/end",
}


def scheme_name(row: dict) -> str:
    """The row's scheme as the text table names it: its residual, or desync and its pattern
    (`DESYNC_NAMES`; "desync/own" for explicit sync pairs)."""
    rp = row.get("reduce_pattern")
    if row["residual"] != "desync":
        return row["residual"]
    return DESYNC_NAMES.get(rp, "desync/own") if isinstance(rp, str) else "desync/own"


def desync_note(rows: list[dict]) -> str:
    """What the desync rows' names mean, when the rows have any."""
    if not any(r["residual"] == "desync" for r in rows):
        return ""
    return (
        "desync/1L: one all-reduce per layer (reduce_pattern every_layer), desync/2L: one "
        "every two layers (every_2_layers), desync/end: the last layer's only (final_only), "
        "desync/own: the given sync pairs; desync_tp is the row's tp"
    )


def _implementation(row: dict) -> str:
    """ "" for NCCL's all-reduces (the default), else "+one_shot" and the like."""
    a = row.get("allreduce", "nccl")
    return "" if a == "nccl" else f"+{a}"


def decision(rows: list[dict]) -> list[dict]:
    """The comparison a team deciding on the ladder asks for, one dict per (link, tp, batch):
    tokens/s of standard with NCCL (`standard`), standard with the fastest all-reduce
    implementation the rows hold (`standard_best`, named in `standard_best_allreduce`), the
    ladder with NCCL and with its fastest, parallel and upper_bound at their fastest, and
    `ladder_buys`: the ladder at its fastest over standard at its fastest (None where a scheme
    is missing)."""
    cells: dict = {}
    for r in rows:
        c = cells.setdefault((r["link"], r["tp"], r["batch"]), {})
        c.setdefault(r["residual"], []).append(r)
    out = []
    for (link, tp, batch), by in cells.items():
        d = {"link": link, "tp": tp, "batch": batch}
        for scheme in ("standard", "ladder", "parallel", "upper_bound"):
            rs = by.get(scheme, [])
            nccl = [r for r in rs if r.get("allreduce", "nccl") == "nccl"]
            best = max(rs, key=lambda r: r["tokens_per_s"], default=None)
            d[scheme] = nccl[0]["tokens_per_s"] if nccl else None
            d[f"{scheme}_best"] = best["tokens_per_s"] if best else None
            d[f"{scheme}_best_allreduce"] = best.get("allreduce", "nccl") if best else None
        std, lad = d["standard_best"], d["ladder_best"]
        d["ladder_buys"] = lad / std if std and lad else None
        out.append(d)
    return out


def format_decision(cells: list[dict]) -> str:
    """`decision` as a table, and per cell one line saying what the ladder buys over the best
    standard configuration."""
    head = (
        f"{'link':<7} {'tp':>3} {'batch':>5} {'std+nccl':>9} {'std+best':>9} {'lad+nccl':>9} "
        f"{'lad+best':>9} {'parallel':>9} {'upper':>9}   (tokens/s)"
    )
    lines, says = [head], []
    cell = lambda v: f"{v:>9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
    for d in cells:
        lines.append(
            f"{d['link']:<7} {d['tp']:>3} {d['batch']:>5} {cell(d['standard'])} "
            f"{cell(d['standard_best'])} {cell(d['ladder'])} {cell(d['ladder_best'])} "
            f"{cell(d['parallel_best'])} {cell(d['upper_bound_best'])}"
        )
        if d["ladder_buys"] is not None:
            says.append(
                f"{d['link']} tp={d['tp']} batch={d['batch']}: the ladder "
                f"(+{d['ladder_best_allreduce']}) buys {d['ladder_buys']:.3f}x over the best "
                f"standard configuration (standard+{d['standard_best_allreduce']})"
            )
    return "\n".join(lines + says)
