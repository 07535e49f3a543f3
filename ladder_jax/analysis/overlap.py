"""Deviceless GPU programs and their schedules: every all-reduce, every other collective and the
memory per device of a program compiled for an NVIDIA GPU target on a machine with no GPU.
What counts as overlapped: docs/analysis.md, 'See the overlap'.

    python -m ladder_jax.overlap --preset llama-3-8b --tp 8 --phase decode"""

from __future__ import annotations

import dataclasses

from ladder_jax import hardware, train_config
from ladder_jax.analysis.hlo import SCOPE, HloError, Module, nbytes
from ladder_jax.analysis.programs import OverlapError, compile_program, compile_train_config
from ladder_jax.train import step


def read_all_reduces(hlo: str, d_model: int, allreduce: str = "nccl") -> list[dict]:
    """Every all-reduce of a scheduled HLO module, in schedule order (see the module doc).

    `kind` says what it reduces: `module` (a layer's attention / MLP output in the forward,
    its input cotangent in the backward: what the residual scheme is about), `head` (the LM
    head's input cotangent), `weight_grad` (gradient of a weight replicated over tp),
    `loss` (log-sum-exp and target logit over the vocab-sharded logits) or `optimizer`
    (scalar reductions such as the gradient norm). `kernel`: what runs it, nccl, or with
    `allreduce="one_shot"` the kernel XLA annotated it with (one_shot, two_shot; nccl where
    the message is too large for them).
    """
    module = _module(hlo)
    found = []
    for cname, ops in module.computations.items():
        for i, op in enumerate(ops):
            if op.opcode not in ("all-reduce-start", "all-reduce"):
                continue
            if op.opcode == "all-reduce":
                done, between, is_sync = op, [], True
            else:
                j = module.done_of(cname, i)
                done, between, is_sync = ops[j], ops[i + 1 : j], op.is_sync
            scope = SCOPE.search(op.op_name)
            dims = done.dims
            activation = len(dims) == 3 and dims[-1] == d_model
            if "shard_map" not in op.op_name:
                kind = "loss" if len(dims) > 1 or "jvp(" in op.op_name else "optimizer"
            elif not activation:
                kind = "optimizer" if not dims else "weight_grad"
            else:
                kind = "module" if scope else "head" if "/head/" in op.op_name else "other"
            asynchronous = op.opcode == "all-reduce-start" and not is_sync
            gemms = sum(o.is_matmul() for o in between) if asynchronous else 0
            found.append(
                {
                    "pass": "backward" if "transpose(" in op.op_name else "forward",
                    "kind": kind,
                    "layer": int(scope.group(1)) if scope else None,
                    "module": scope.group(2) if scope else None,
                    "asynchronous": asynchronous,
                    "gemms_between": gemms,
                    "overlapped": gemms >= 1,
                    "bytes": nbytes(done.shape),
                    "kernel": (op.kernel_strategy if allreduce == "one_shot" else "") or "nccl",
                    "computation": cname,
                    "op_name": op.op_name,
                }
            )
    return found


def _module(hlo: str) -> Module:
    try:
        return Module(hlo)
    except HloError as e:
        raise OverlapError(str(e)) from None


def _mesh_axis(group: list[int] | None, data: int, tp: int) -> str:
    """Which axis of a (data, tp) mesh (devices numbered row by row) a replica group spans."""
    if not group:
        return "?"
    if sorted(group) == list(range(group[0], group[0] + len(group))) and len(group) == tp:
        return "tp"
    if len(group) == data * tp:
        return "all"
    if len(group) == data and all(b - a == tp for a, b in zip(group, group[1:])):
        return "data"
    return f"{len(group)} devices"


def read_collectives(hlo: str, *, data: int, tp: int) -> list[dict]:
    """Every collective of a scheduled HLO module (`hlo.COLLECTIVES`), in schedule order, with
    the mesh axis it runs over (`tp`, `data` or `all` of a (data, tp) mesh), its bytes (the
    result, per device), where it sits (`loop`: inside a while loop's body, e.g. once per
    accumulated micro-batch; `step`: once per step) and whether it is overlapped
    (asynchronous, with a matmul scheduled between its start and done, as in
    `read_all_reduces`)."""
    module = _module(hlo)
    bodies = module.loop_bodies()
    found = []
    for cname, ops in module.computations.items():
        for i, op in enumerate(ops):
            if op.opcode.startswith("async") or op.opcode.endswith("-done"):
                continue
            base = module.collective(op)
            if base is None:
                continue
            if op.opcode == base:
                done, between, asynchronous = op, [], False
            else:
                j = module.done_of(cname, i)
                if j is None:
                    continue
                done, between = ops[j], ops[i + 1 : j]
                asynchronous = not op.is_sync
            gemms = sum(o.is_matmul() for o in between) if asynchronous else 0
            found.append(
                {
                    "collective": base,
                    "axis": _mesh_axis(op.replica_group, data, tp),
                    "bytes": nbytes(done.shape),
                    "where": "loop" if cname in bodies else "step",
                    "asynchronous": asynchronous,
                    "gemms_between": gemms,
                    "overlapped": gemms >= 1,
                    "computation": cname,
                    "op_name": op.op_name,
                }
            )
    return found


def summarize_collectives(collectives: list[dict]) -> list[dict]:
    """One row per (collective, axis, where): count, overlapped count, total bytes."""
    rows = {}
    for c in collectives:
        key = (c["collective"], c["axis"], c["where"])
        r = rows.setdefault(
            key,
            {
                "collective": key[0],
                "axis": key[1],
                "where": key[2],
                "count": 0,
                "overlapped": 0,
                "bytes": 0,
            },
        )
        r["count"] += 1
        r["overlapped"] += c["overlapped"]
        r["bytes"] += c["bytes"]
    return list(rows.values())


def summarize(all_reduces: list[dict]) -> dict:
    """Totals, plus per pass over the all-reduces of the layers and head (kind module/head):
    `all_but_last_overlapped` is the ladder's promise for that pass."""
    out = {
        "total_all_reduces": len(all_reduces),
        "overlapped_all_reduces": sum(r["overlapped"] for r in all_reduces),
        "by_kind": {},
    }
    for r in all_reduces:
        k = out["by_kind"].setdefault(r["kind"], {"total": 0, "overlapped": 0})
        k["total"] += 1
        k["overlapped"] += r["overlapped"]
    for p in ("forward", "backward"):
        rs = [r for r in all_reduces if r["pass"] == p and r["kind"] in ("module", "head")]
        out[p] = {
            "total": len(rs),
            "overlapped": sum(r["overlapped"] for r in rs),
            "all_but_last_overlapped": bool(rs) and all(r["overlapped"] for r in rs[:-1]),
            "module_overlapped": sum(r["overlapped"] for r in rs if r["kind"] == "module"),
            "kernels": _counts(r["kernel"] for r in rs),
        }
    return out


def _counts(names) -> dict:
    out: dict = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out


def report(
    config,
    *,
    phase: str,
    tp: int,
    batch: int,
    seq: int,
    target: str = "h100",
    new_tokens: int = 512,
    hosts: int = 1,
    hlo_file: str | None = None,
    allreduce: str = "nccl",
    draft: int = 4,
) -> dict:
    """Compile and read: the JSON-able report that `python -m ladder_jax.overlap` prints.
    `hlo_file`: also write the scheduled HLO text there; `allreduce`: how the program's
    all-reduces run (`compilation.ALLREDUCES`); each all-reduce's `kernel` says which one XLA
    gave it (nccl, one_shot, two_shot), each pass's `module_overlapped` how many module
    all-reduces still overlap a matmul; `draft`: the verify phase's drafted tokens per row."""
    hlo, seconds = compile_program(
        config,
        phase=phase,
        tp=tp,
        batch=batch,
        seq=seq,
        target=target,
        new_tokens=new_tokens,
        hosts=hosts,
        **({"allreduce": allreduce} if allreduce != "nccl" else {}),
        **({"draft": draft} if phase == "verify" else {}),
    )
    _dump(hlo, hlo_file)
    ars = read_all_reduces(hlo, config.d_model, allreduce)
    return {
        "preset_config": dataclasses.asdict(config),
        "residual": config.residual,
        "ladder_layers": config.ladder_layers,
        "phase": phase,
        "tp": tp,
        "batch": batch,
        "seq": seq,
        **({"draft": draft} if phase == "verify" else {}),
        "target": target,
        "hosts": hosts,
        "allreduce": allreduce,
        "compile_seconds": round(seconds, 2),
        **summarize(ars),
        "all_reduces": ars,
    }


def _dump(hlo: str, path: str | None) -> None:
    if path:
        try:
            with open(path, "w") as f:
                f.write(hlo)
        except OSError as e:
            raise OverlapError(f"--dump-hlo {path}: cannot write it ({e.strerror})") from None


def report_config(
    cfg,
    *,
    hosts: int = 1,
    gpus_per_host: int = 8,
    target: str = "h100",
    hlo_file: str | None = None,
) -> dict:
    """Compile the training step of `cfg` (`compile_train_config`) and read it: the module
    all-reduces (`read_all_reduces`), every other collective (`read_collectives`) and the
    per-device memory (`step.memory_use`) against the target's capacity. JSON-able."""

    compiled, mesh, seconds = compile_train_config(
        cfg, hosts=hosts, gpus_per_host=gpus_per_host, target=target
    )
    model = train_config.model_config(cfg)
    hlo = compiled.as_text()
    _dump(hlo, hlo_file)
    data, tp = mesh.shape["data"], mesh.shape["tp"]
    ars = read_all_reduces(hlo, model.d_model)
    collectives = read_collectives(hlo, data=data, tp=tp)
    memory = step.memory_use(compiled)
    capacity = hardware.CHIPS[target].memory_bytes
    d = cfg.data
    return {
        "config": cfg.name,
        "preset": cfg.model.preset,
        "residual": model.residual,
        "ladder_layers": model.ladder_layers,
        "remat": model.remat,
        "phase": "train",
        "hosts": hosts,
        "gpus": hosts * gpus_per_host,
        "data": data,
        "tp": tp,
        "fsdp": cfg.mesh.fsdp,
        "batch": d.batch_size,
        "grad_accum": d.grad_accum,
        "seq": d.seq_len,
        "tokens_per_step": d.batch_size * d.grad_accum * d.seq_len,
        "target": target,
        "compile_seconds": round(seconds, 2),
        "memory": memory,
        "peak_bytes_per_device": memory["peak"],
        "device_memory_bytes": capacity,
        "fits": memory["peak"] <= capacity,
        **summarize(ars),
        "collectives": summarize_collectives(collectives),
        "all_reduces": ars,
    }


def format_memory(rep: dict) -> str:
    m, gib = rep["memory"], 1024**3
    parts = [
        f"arguments {m['arguments'] / gib:.2f} (weights, optimizer state, batch)",
        f"outputs {m['outputs'] / gib:.2f} ({m['aliased'] / gib:.2f} in place)",
        f"temporaries {m['temporaries'] / gib:.2f}",
    ]
    return (
        f"memory per device, GiB: {', '.join(parts)}; peak {m['peak'] / gib:.2f} of "
        f"{rep['device_memory_bytes'] / gib:.2f} ({rep['target']})"
        + ("" if rep["fits"] else ": DOES NOT FIT")
    )


def format_collectives(rep: dict) -> str:
    lines = [
        f"{'collective':<19} {'axis':<5} {'where':<5} {'count':>6} {'overlapped':>10} {'MiB':>10}"
    ]
    for r in rep["collectives"]:
        lines.append(
            f"{r['collective']:<19} {r['axis']:<5} {r['where']:<5} {r['count']:>6} "
            f"{r['overlapped']:>10} {r['bytes'] / 2**20:>10.2f}"
        )
    return "\n".join(lines)


def format_table(rep: dict) -> str:
    lines = [
        f"{'#':>3} {'pass':<8} {'kind':<11} {'layer':>5} {'module':<8} {'sync?':<6} "
        f"{'GEMMs between':>13} {'bytes':>12}"
    ]
    for i, r in enumerate(rep["all_reduces"]):
        layer = "-" if r["layer"] is None else r["layer"]
        lines.append(
            f"{i:>3} {r['pass']:<8} {r['kind']:<11} {layer:>5} {r['module'] or '-':<8} "
            f"{'async' if r['asynchronous'] else 'sync':<6} {r['gemms_between']:>13} "
            f"{r['bytes']:>12,}"
        )
    return "\n".join(lines)


def verdict(rep: dict) -> str:
    parts = []
    for p in ("forward", "backward"):
        s = rep[p]
        if s["total"]:
            tail = " (all but the last)" if s["all_but_last_overlapped"] and s["total"] > 1 else ""
            kernels = ", ".join(f"{n} {k}" for k, n in sorted(s.get("kernels", {}).items()))
            parts.append(f"{p} {s['overlapped']}/{s['total']}{tail} [{kernels}]")
    others = {k: v for k, v in rep["by_kind"].items() if k not in ("module", "head")}
    other = "".join(f"; {k}: {v['overlapped']}/{v['total']}" for k, v in sorted(others.items()))
    ll = f" ladder_layers={rep['ladder_layers']}" if rep["ladder_layers"] is not None else ""
    phase = rep["phase"] + (f" draft={rep['draft']}" if "draft" in rep else "")
    return (
        f"{rep['residual']}{ll} {phase} tp={rep['tp']} on {rep['target']}: layer "
        f"all-reduces overlapping a matmul: {', '.join(parts)}{other}; compiled in "
        f"{rep['compile_seconds']:.1f}s"
    )
