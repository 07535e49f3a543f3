"""Predict what each residual scheme buys: tokens/s of generation on a GPU you do not have,
from the schedule XLA compiles for it.

    python -m ladder_jax.predict --preset llama-3-70b --tp 8 --batch 1 --prompt-len 1024 \\
        --new-tokens 512 --link nvlink --target h100 --residual all
    python -m ladder_jax.predict --preset llama-3-70b --tp 2 4 8 --batch 1 4 16 \\
        --link nvlink pcie --json

How. On a CPU, with no GPU:
1. Compile, deviceless (as `ladder_jax.analysis.overlap` does for `python -m ladder_jax.overlap`), the programs users run:
   `ladder_jax.inference.generation.Decoder`'s jitted prefill and one-token step, with the KV cache sized as
   `decode` sizes it and the decode CLI's sampling (temperature 0.8, top-k 200), for `tp`
   abstract GPUs of `--target`, with the package's compiler options.
2. Read the scheduled ENTRY computation: kernels in launch order, and every collective as a
   `*-start` / `*-done` pair (or one synchronous op).
3. Cost every kernel as a roofline: max(FLOPs / (dense bf16 rate x gemm efficiency),
   bytes / (HBM bandwidth x memory efficiency)) + a fixed per-kernel overhead. FLOPs are those
   of the kernel's `dot`s (2 x output elements x contracted size; a matmul XLA rewrote as a
   multiply-reduce counts 2 per element of its largest intermediate). Bytes are what the
   kernel reads and writes: a fused parameter only sliced inside the kernel counts the slice,
   a buffer updated in place (the KV cache) counts the update, not the buffer.
4. Cost every collective with the link's ring model (`hardware.Link`): a latency per call
   and per ring step plus bytes over the bus bandwidth nccl-tests reports.
5. Simulate two streams, compute and collectives, exactly as scheduled: a `start` issues its
   collective once the compute stream reaches it and the collective stream is free; a `done`
   makes the compute stream wait for it; a synchronous collective blocks both. The time the
   compute stream spends waiting is the *exposed* communication.
6. tokens_per_s = batch * new_tokens / (prefill_s + (new_tokens - 1) * decode_step_s), the
   way the paper's benchmark counts it (the prefill emits the first token).

Training (`--phase train --config configs/X.yaml`): the training step of `ladder_jax.analysis.overlap`
(forward, backward, AdamW update) for the config's model, micro-batch, sequence length and
`mesh.tp`, costed the same way; step_s is `data.grad_accum` micro-steps, tokens_per_s is per
data-parallel replica (`data.batch_size / mesh.data` sequences: the replicas' gradient
all-reduce is not modelled). Large models trained at full depth can lose overlap that a
3-4 layer compile keeps (XLA's scheduler stops hiding collectives under memory pressure):
check with `--layers-compiled 0` when it matters.

Few layers, extended. A 70B-wide program takes seconds to compile, mostly a fixed cost, so by
default (`--layers-compiled 4`) the model is compiled with 3 and with 4 layers, and the
predicted times are extended linearly to the full depth: the difference of the two is one more
layer in the middle of the stack, past the first layer's and before the last layer's special
cases (the first layers fuse a little differently, so shallower pairs are off by up to a few
percent). Tests check the extension against full-depth compiles (within 1%). Hybrid ladders
(`--ladder-layers`) are compiled at full depth: their layers differ. Programs are compiled
once per process (links and knobs re-cost the same schedule), `--jobs` at a time.

The calibration (chip rates in `hardware.CHIPS`; `hardware.LINKS`, `hardware.EFFICIENCY`) is
public figures with their sources, never fitted to a measured model throughput. Flags override
each figure; the README says how to set them from nccl-tests output on your own cluster.

What the model leaves out (footguns): NCCL kernels share the GPU's SMs and memory bandwidth
with the matmuls they overlap (here they are free); kernels run alone (no concurrent kernels);
host work is assumed hidden (the decode loop queues steps ahead, as `decode` does); the
deviceless compile is not autotuned, so GEMM tiling may differ from a GPU's; kernel times
come from rates, not from the kernels' code. It predicts *this package's* programs, e.g. its
prefill attention materializes the scores (no flash attention) and its decode step attends
over every cache slot.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import re

from ladder_jax import hardware
from ladder_jax.analysis import hlo, programs
from ladder_jax.config import RESIDUALS
from ladder_jax.model import sharding


class PredictError(ValueError):
    """Arguments the model cannot run with; the message says what to use instead."""


# ---------------------------------------------------------------------------------------------
# Reading the scheduled program: one Kernel per entry that takes time.


@dataclasses.dataclass(frozen=True)
class Kernel:
    """`kind`: compute (a kernel on the compute stream), start / done (an async collective:
    `name` pairs them), sync (a collective that blocks both streams). `nbytes` is what a
    compute kernel moves through HBM, or the collective's message size."""

    kind: str
    name: str
    flops: float = 0.0
    nbytes: float = 0.0
    collective: str = ""
    layer: int | None = None


_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
         "replica-id", "opt-barrier", "after-all", "add-dependency", "domain", "iota"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                "all-to-all", "collective-broadcast", "ragged-all-to-all")
_SLICES = {"dynamic-slice", "slice", "gather"}


def _dims(shape: str) -> list[int]:
    m = hlo.ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _elements(shape: str) -> int:
    return math.prod(_dims(shape))


def _operands(op) -> list[str]:
    """Operand names of an instruction, in order (the text between its opcode's parens)."""
    rest = op.arguments
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "(" or -(ch == ")")
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _attr(op, name: str) -> str | None:
    m = re.search(rf"\b{name}=%?([\w.\-]+)", op.text)
    return m.group(1) if m else None


def _is_root(op) -> bool:
    return op.text.lstrip().startswith("ROOT ")


class _Program:
    """The computations of a scheduled HLO module, with name -> instruction tables."""

    def __init__(self, text: str):
        if "is_scheduled=true" not in text.split("\n", 1)[0]:
            raise PredictError("the HLO module is not scheduled: pass compiled, not lowered, text")
        self.comps = hlo.computations(text)
        self.ops = {c: {op.name: op for op in ops} for c, ops in self.comps.items()}

    def flops(self, comp: str) -> float:
        """FLOPs of the dots of `comp` and of the computations its fusions call."""
        total = 0.0
        for op in self.comps.get(comp, ()):
            if op.opcode == "dot":
                lhs = self.ops[comp][_operands(op)[0]].shape
                m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.text)
                contracted = math.prod(_dims(lhs)[int(i)] for i in m.group(1).split(",") if i)
                total += 2.0 * _elements(op.shape) * contracted
            elif op.opcode == "fusion":
                total += self.flops(_attr(op, "calls"))
        return total

    def fusion_cost(self, op) -> tuple[float, float]:
        """(FLOPs, HBM bytes) of an ENTRY fusion."""
        comp = _attr(op, "calls")
        body = self.comps[comp]
        flops = self.flops(comp)
        if not flops and op.op_name.endswith("dot_general"):  # a matmul as multiply-reduce
            flops = 2.0 * max(_elements(o.shape) for o in body)
        users: dict[str, list] = {}
        for o in body:
            for pos, name in enumerate(_operands(o)):
                users.setdefault(name, []).append((o, pos))
        params = {int(re.search(r"parameter\((\d+)\)", o.text).group(1)): o
                  for o in body if o.opcode == "parameter"}
        entry = self.ops["ENTRY"]
        nbytes = 0.0
        for k, name in enumerate(_operands(op)):
            uses = _through_bitcasts(params[k].name, users)
            if uses and all(u.opcode in _SLICES and pos == 0 for u, pos in uses):
                nbytes += sum(hlo.nbytes(u.shape) for u, _ in uses)
            elif uses and all(u.opcode == "dynamic-update-slice" and pos == 0 for u, pos in uses):
                pass  # the buffer updated in place: only the update moves (counted as output)
            else:
                nbytes += hlo.nbytes(entry[name].shape)
        root = next(o for o in body if _is_root(o))
        outs = [self.ops[comp][n] for n in _operands(root)] if root.opcode == "tuple" else [root]
        for o in outs:
            while o.opcode == "bitcast":
                o = self.ops[comp][_operands(o)[0]]
            if o.opcode == "dynamic-update-slice":
                nbytes += hlo.nbytes(self.ops[comp][_operands(o)[1]].shape)
            else:
                nbytes += hlo.nbytes(o.shape)
        return flops, nbytes

    def plain_cost(self, op) -> tuple[float, float]:
        """(FLOPs, bytes) of a non-fusion kernel: operands in, result out."""
        entry = self.ops["ENTRY"]
        nbytes = sum(hlo.nbytes(entry[n].shape) for n in _operands(op) if n in entry)
        nbytes += hlo.nbytes(op.shape)
        flops = 0.0
        if op.opcode == "custom-call" and re.search(r'custom_call_target="__cublas', op.text):
            lhs = entry[_operands(op)[0]].shape
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', op.text)
            idx = [int(i) for i in re.findall(r"\d+", m.group(1))] if m else [len(_dims(lhs)) - 1]
            flops = 2.0 * _elements(op.shape) * math.prod(_dims(lhs)[i] for i in idx)
        return flops, nbytes

    def collective_bytes(self, op) -> float:
        """Message size: the larger of what goes in and what comes out."""
        entry = self.ops["ENTRY"]
        inputs = sum(hlo.nbytes(entry[n].shape) for n in _operands(op) if n in entry)
        total = hlo.nbytes(op.shape)
        outputs = total - inputs if op.opcode.endswith("-start") and total > inputs else total
        return float(max(inputs, outputs))

    def collective_kind(self, op) -> str:
        base = op.opcode.removesuffix("-start")
        if base == "async":  # a wrapped collective: its computation says which
            base = next((o.opcode for o in self.comps.get(_attr(op, "calls"), ())
                         if o.opcode in _COLLECTIVES), "other")
        return base if base in _COLLECTIVES else "other"


def _through_bitcasts(name, users) -> list:
    out = []
    for u, pos in users.get(name, ()):
        out += _through_bitcasts(u.name, users) if u.opcode == "bitcast" else [(u, pos)]
    return out


def read_kernels(text: str) -> list[Kernel]:
    """The ENTRY computation of a scheduled module as Kernels, in schedule order."""
    prog = _Program(text)
    kernels, sync = [], set()
    for op in prog.comps["ENTRY"]:
        scope = hlo.SCOPE.search(op.op_name)
        layer = int(scope.group(1)) if scope else None
        code = op.opcode
        if code in _FREE:
            continue
        if code.endswith("-start") and code != "copy-start":
            kind = "sync" if '"is_sync":true' in op.text else "start"
            if kind == "sync":
                sync.add(op.name)
            kernels.append(Kernel(kind, op.name, nbytes=prog.collective_bytes(op),
                                  collective=prog.collective_kind(op), layer=layer))
        elif code.endswith("-done") and code != "copy-done":
            start = _operands(op)[0]
            if start not in sync:
                kernels.append(Kernel("done", start, layer=layer))
        elif code in _COLLECTIVES:
            kernels.append(Kernel("sync", op.name, nbytes=prog.collective_bytes(op),
                                  collective=code, layer=layer))
        else:
            flops, nbytes = prog.fusion_cost(op) if code == "fusion" else prog.plain_cost(op)
            kernels.append(Kernel("compute", op.name, flops, nbytes, layer=layer))
    return kernels


# ---------------------------------------------------------------------------------------------
# Costs.


def kernel_seconds(k: Kernel, chip: hardware.Chip, eff: hardware.Efficiency) -> float:
    """Roofline of one compute kernel plus the fixed per-kernel overhead."""
    return max(k.flops / (chip.bf16_flops * eff.gemm),
               k.nbytes / (chip.hbm_bytes_per_s * eff.memory)) + eff.kernel_overhead_s


def collective_seconds(collective: str, nbytes: float, ranks: int, link: hardware.Link,
                       algorithm: str = "ring") -> float:
    """NCCL-style ring (or tree) time of one collective of `nbytes` over `ranks` GPUs."""
    if ranks <= 1:
        return 0.0
    if collective == "all-reduce":
        steps = 2 * math.ceil(math.log2(ranks)) if algorithm == "tree" else 2 * (ranks - 1)
        traffic = 2 * (ranks - 1) / ranks
    elif collective in ("all-gather", "reduce-scatter"):
        steps, traffic = ranks - 1, (ranks - 1) / ranks
    else:
        steps, traffic = 1, 1.0
    return (link.base_latency_s + steps * link.hop_latency_s
            + nbytes * traffic / link.bus_bytes_per_s)


def costed(kernels, *, chip, link, efficiency, ranks, algorithm="ring") -> list[tuple]:
    """(kind, name, seconds, layer) per kernel: what `simulate` runs."""
    out = []
    for k in kernels:
        if k.kind == "compute":
            s = kernel_seconds(k, chip, efficiency)
        elif k.kind == "done":
            s = 0.0
        else:
            s = collective_seconds(k.collective, k.nbytes, ranks, link, algorithm)
        out.append((k.kind, k.name, s, k.layer))
    return out


# ---------------------------------------------------------------------------------------------
# Two streams.


@dataclasses.dataclass(frozen=True)
class Timeline:
    seconds: float  # until both streams are idle
    compute_s: float  # busy time of the compute stream
    comm_s: float  # busy time of the collective stream

    @property
    def exposed_comm_s(self) -> float:
        return self.seconds - self.compute_s


def simulate(steps) -> Timeline:
    """Runs (kind, name, seconds, layer) steps on a compute and a collective stream.

    compute: runs on the compute stream. start: the collective is issued when the compute
    stream reaches it and runs on the collective stream after the collectives before it.
    done: the compute stream waits until that collective has finished. sync: a blocking
    collective (waits for the collective stream, then holds both)."""
    now = free = busy = comm = 0.0
    ends = {}
    for kind, name, seconds, _ in steps:
        if kind == "compute":
            now += seconds
            busy += seconds
        elif kind == "start":
            free = max(now, free) + seconds
            ends[name] = free
            comm += seconds
        elif kind == "done":
            now = max(now, ends.pop(name))
        elif kind == "sync":
            now = free = max(now, free) + seconds
            comm += seconds
        else:
            raise ValueError(f"unknown step kind {kind!r}")
    return Timeline(max(now, free), busy, comm)


def extended(shallow: Timeline, deep: Timeline, n_layers: int, deep_layers: int
             ) -> tuple[float, float]:
    """(seconds, compute seconds) at `n_layers`, from timelines of `deep_layers - 1` and
    `deep_layers` layers: each missing layer adds their difference."""
    extra = n_layers - deep_layers
    return (deep.seconds + extra * (deep.seconds - shallow.seconds),
            deep.compute_s + extra * (deep.compute_s - shallow.compute_s))


# ---------------------------------------------------------------------------------------------
# Programs and predictions.


@functools.lru_cache(maxsize=None)
def program_kernels(config, *, phase: str, tp: int, batch: int, prompt_len: int,
                    new_tokens: int, target: str) -> tuple[Kernel, ...]:
    """The compiled program's kernels (compiled once per process and shape)."""
    text, _ = programs.compile_program(config, phase=phase, tp=tp, batch=batch, seq=prompt_len,
                                     target=target, new_tokens=new_tokens)
    return tuple(read_kernels(text))


def check_layers_compiled(layers_compiled: int) -> None:
    if layers_compiled != 0 and layers_compiled < 2:
        raise PredictError(f"--layers-compiled {layers_compiled}: use 0 (full depth) or >= 2 "
                           f"(that many layers and one fewer are compiled; 4 is accurate)")


def compiled_depths(config, layers_compiled: int) -> list[int]:
    """The depths compiled for `config`: all layers, or `layers_compiled` and one fewer."""
    check_layers_compiled(layers_compiled)
    if (not layers_compiled or config.ladder_layers is not None
            or config.n_layers <= layers_compiled):
        return [config.n_layers]
    return [layers_compiled - 1, layers_compiled]


def compile_all(tasks: list[dict], jobs: int | None = None, progress=None) -> None:
    """Compiles the `program_kernels(**task)` of every task, `jobs` threads at a time
    (default 1: tracing and lowering hold Python's lock, so threads pay off only on idle
    cores), so that later calls hit the cache."""
    todo = list({tuple(sorted(t.items())): t for t in tasks}.values())
    jobs = max(1, jobs or 1)
    if progress:
        progress(f"{len(todo)} programs, {min(jobs, len(todo))} at a time")
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for f in [pool.submit(lambda t: program_kernels(**t), t) for t in todo]:
            f.result()


def _tasks(config, phases, depths, **shape) -> list[dict]:
    return [dict(config=dataclasses.replace(config, n_layers=d), phase=p, **shape)
            for p in phases for d in depths]


def program_time(config, *, phase: str, tp: int, batch: int, prompt_len: int, new_tokens: int,
                 target: str = "h100", link: hardware.Link, efficiency: hardware.Efficiency,
                 layers_compiled: int = 4, algorithm: str = "ring") -> dict:
    """Predicted seconds, compute seconds and exposed communication of one program."""
    depths = compiled_depths(config, layers_compiled)
    full = depths == [config.n_layers]
    timelines, kernels = [], ()
    for depth in depths:
        kernels = program_kernels(dataclasses.replace(config, n_layers=depth), phase=phase,
                                  tp=tp, batch=batch, prompt_len=prompt_len,
                                  new_tokens=new_tokens, target=target)
        timelines.append(simulate(costed(kernels, chip=hardware.CHIPS[target], link=link,
                                         efficiency=efficiency, ranks=tp, algorithm=algorithm)))
    if full:
        seconds, compute = timelines[0].seconds, timelines[0].compute_s
    else:  # the two depths can fuse a kernel differently: keep 0 <= exposed <= seconds
        seconds, compute = extended(*timelines, config.n_layers, layers_compiled)
        compute = min(compute, seconds)
    return {"seconds": seconds, "compute_s": compute, "exposed_comm_s": seconds - compute,
            "kernels": sum(k.kind == "compute" for k in kernels), "layers_compiled": depths}


def check(config, *, tp: int, batch: int, prompt_len: int, new_tokens: int, link: str,
          target: str, residual: str) -> None:
    """Every argument, before anything compiles: one line naming the fix."""

    if link not in hardware.LINKS:
        raise PredictError(f"unknown link {link!r}: choose one of {', '.join(hardware.LINKS)}")
    if target not in hardware.TARGETS:
        raise PredictError(f"unknown target {target!r}: choose one of "
                           f"{', '.join(hardware.TARGETS)}")
    if residual not in RESIDUALS:
        raise PredictError(f"unknown residual {residual!r}: choose one of "
                           f"{', '.join(RESIDUALS)} or all")
    for name, v in (("tp", tp), ("batch", batch), ("prompt_len", prompt_len),
                    ("new_tokens", new_tokens)):
        if not isinstance(v, int) or v < 1:
            raise PredictError(f"{name}={v!r} must be a positive integer")
    sharding.check_divisible(config, tp)


def predict(config, *, tp=(8,), batch=(1,), prompt_len: int = 1024, new_tokens: int = 512,
            links=("nvlink",), target: str = "h100", residuals=RESIDUALS,
            efficiency: hardware.Efficiency | None = None, link_overrides: dict | None = None,
            layers_compiled: int = 4, algorithm: str = "ring", jobs: int | None = None,
            progress=None, quantize: str | None = None) -> list[dict]:
    """One row per (tp, batch, residual, link): predicted prefill and decode-step seconds,
    tokens/s (all users and per user) and exposed communication. `config` is a ModelConfig
    (its `residual` is replaced by each of `residuals`; `ladder_layers` kept for ladder);
    `link_overrides` replace fields of every link (e.g. bus_bytes_per_s=300e9);
    `quantize="int8"`: the int8-weight programs (`ladder_jax.model.quant`)."""
    if quantize is not None:
        config = dataclasses.replace(config, quantize=quantize)
    tps, batches = _as_tuple(tp), _as_tuple(batch)
    links, residuals = _as_tuple(links), _as_tuple(residuals)
    if algorithm not in ("ring", "tree"):
        raise PredictError(f"unknown algorithm {algorithm!r}: choose ring or tree")
    check_layers_compiled(layers_compiled)
    for t in tps:
        for b in batches:
            for name in links:
                for r in residuals:
                    check(config, tp=t, batch=b, prompt_len=prompt_len, new_tokens=new_tokens,
                          link=name, target=target, residual=r)
    programs.check_plugin()
    efficiency = efficiency or hardware.EFFICIENCY
    chosen = {n: dataclasses.replace(hardware.LINKS[n], **(link_overrides or {})) for n in links}
    base = dataclasses.replace(config, max_seq_len=max(config.max_seq_len,
                                                       prompt_len + new_tokens))
    cases = [(t, b, dataclasses.replace(base, residual=r, ladder_layers=(
        base.ladder_layers if r == "ladder" else None))) for t in tps for b in batches
        for r in residuals]
    compile_all([task for t, b, cfg in cases for task in _tasks(
        cfg, ("prefill", "decode"), compiled_depths(cfg, layers_compiled), tp=t, batch=b,
        prompt_len=prompt_len, new_tokens=new_tokens, target=target)], jobs, progress)
    rows = []
    for t, b, cfg in cases:
        for name, link in chosen.items():
            kw = dict(tp=t, batch=b, prompt_len=prompt_len, new_tokens=new_tokens,
                      target=target, link=link, efficiency=efficiency,
                      layers_compiled=layers_compiled, algorithm=algorithm)
            pre = program_time(cfg, phase="prefill", **kw)
            step = program_time(cfg, phase="decode", **kw)
            rows.append(_row(cfg, t, b, prompt_len, new_tokens, name, target, pre, step))
    return rows


def predict_train(config, *, tp=(8,), batch: int, seq_len: int, grad_accum: int = 1,
                  links=("nvlink",), target: str = "h100", residuals=RESIDUALS,
                  efficiency: hardware.Efficiency | None = None,
                  link_overrides: dict | None = None, layers_compiled: int = 4,
                  algorithm: str = "ring", jobs: int | None = None,
                  progress=None) -> list[dict]:
    """One row per (tp, residual, link) for a training step of `batch` sequences of
    `seq_len` tokens, `grad_accum` times (see the module doc)."""
    tps, links, residuals = _as_tuple(tp), _as_tuple(links), _as_tuple(residuals)
    check_layers_compiled(layers_compiled)
    for t in tps:
        for name in links:
            for r in residuals:
                check(config, tp=t, batch=batch, prompt_len=seq_len, new_tokens=grad_accum,
                      link=name, target=target, residual=r)
    programs.check_plugin()
    efficiency = efficiency or hardware.EFFICIENCY
    chosen = {n: dataclasses.replace(hardware.LINKS[n], **(link_overrides or {})) for n in links}
    cases = [(t, dataclasses.replace(config, residual=r, ladder_layers=(
        config.ladder_layers if r == "ladder" else None))) for t in tps for r in residuals]
    compile_all([task for t, cfg in cases for task in _tasks(
        cfg, ("train",), compiled_depths(cfg, layers_compiled), tp=t, batch=batch,
        prompt_len=seq_len, new_tokens=1, target=target)], jobs, progress)
    rows = []
    for t, cfg in cases:
        r = cfg.residual
        for name, link in chosen.items():
            step = program_time(cfg, phase="train", tp=t, batch=batch, prompt_len=seq_len,
                                new_tokens=1, target=target, link=link,
                                efficiency=efficiency, layers_compiled=layers_compiled,
                                algorithm=algorithm)
            step_s = grad_accum * step["seconds"]
            rows.append({
                "phase": "train", "residual": r, "ladder_layers": cfg.ladder_layers,
                "tp": t, "batch": batch, "seq_len": seq_len, "grad_accum": grad_accum,
                "link": name, "target": target, "step_s": step_s,
                "tokens_per_s": grad_accum * batch * seq_len / step_s,
                "exposed_comm_s": grad_accum * step["exposed_comm_s"],
                "compute_s": grad_accum * step["compute_s"],
                "layers_compiled": step["layers_compiled"], "n_layers": cfg.n_layers})
    return rows


def _as_tuple(v) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


def _row(cfg, tp, batch, prompt_len, new_tokens, link, target, pre, step) -> dict:
    total = pre["seconds"] + (new_tokens - 1) * step["seconds"]
    tokens_per_s = batch * new_tokens / total
    return {
        "residual": cfg.residual, "ladder_layers": cfg.ladder_layers, "tp": tp, "batch": batch,
        "quantize": cfg.quantize,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "link": link, "target": target,
        "prefill_s": pre["seconds"], "decode_step_s": step["seconds"],
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_user": tokens_per_s / batch,
        "exposed_comm_s": pre["exposed_comm_s"] + (new_tokens - 1) * step["exposed_comm_s"],
        "prefill_exposed_comm_s": pre["exposed_comm_s"],
        "decode_step_exposed_comm_s": step["exposed_comm_s"],
        "decode_step_compute_s": step["compute_s"],
        "decode_step_kernels": step["kernels"], "layers_compiled": step["layers_compiled"],
        "n_layers": cfg.n_layers,
    }


def with_ratios(rows: list[dict]) -> list[dict]:
    """Adds `vs_standard`: tokens/s over the standard row of the same link, tp and batch."""
    key = lambda r: (r["link"], r["tp"], r["batch"])  # noqa: E731
    std = {key(r): r["tokens_per_s"] for r in rows if r["residual"] == "standard"}
    return [{**r, "vs_standard": r["tokens_per_s"] / std[key(r)] if key(r) in std else None}
            for r in rows]


def format_train_table(rows: list[dict]) -> str:
    lines = [f"{'link':<7} {'tp':>3} {'residual':<12} {'step ms':>10} {'exposed ms':>10} "
             f"{'tokens/s':>10} {'vs standard':>11}"]
    for r in with_ratios(rows):
        ratio = "-" if r["vs_standard"] is None else f"{r['vs_standard']:.3f}x"
        lines.append(f"{r['link']:<7} {r['tp']:>3} {r['residual']:<12} {r['step_s'] * 1e3:>10.1f} "
                     f"{r['exposed_comm_s'] * 1e3:>10.1f} {r['tokens_per_s']:>10.0f} {ratio:>11}")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'link':<7} {'tp':>3} {'batch':>5} {'residual':<12} {'prefill ms':>10} "
             f"{'decode ms/tok':>13} {'exposed ms/tok':>14} {'tokens/s':>10} "
             f"{'tok/s/user':>10} {'vs standard':>11}"]
    order = {name: i for i, name in enumerate(hardware.LINKS)}
    rows = sorted(with_ratios(rows), key=lambda r: (order.get(r["link"], 99), r["tp"], r["batch"]))
    for r in rows:
        ratio = "-" if r["vs_standard"] is None else f"{r['vs_standard']:.3f}x"
        lines.append(f"{r['link']:<7} {r['tp']:>3} {r['batch']:>5} {r['residual']:<12} "
                     f"{r['prefill_s'] * 1e3:>10.1f} {r['decode_step_s'] * 1e3:>13.3f} "
                     f"{r['decode_step_exposed_comm_s'] * 1e3:>14.3f} "
                     f"{r['tokens_per_s']:>10.1f} {r['tokens_per_s_per_user']:>10.1f} "
                     f"{ratio:>11}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """ladder/standard and upper_bound/standard, one line per link, tp and batch."""
    out = []
    order = {name: i for i, name in enumerate(hardware.LINKS)}
    for r in sorted(with_ratios(rows), key=lambda r: order.get(r["link"], 99)):
        if r["residual"] in ("ladder", "upper_bound") and r["vs_standard"] is not None:
            out.append((r["link"], r["tp"], r["batch"], r["residual"], r["vs_standard"]))
    by = {}
    for link, tp, b, res, v in out:
        by.setdefault((link, tp, b), {})[res] = v
    return "\n".join(
        f"{link} tp={tp} batch={b}: " + ", ".join(f"{k}/standard {v:.3f}" for k, v in d.items())
        for (link, tp, b), d in by.items())


def check_knobs(eff: hardware.Efficiency, link_overrides: dict) -> None:
    for name, v in (("gemm efficiency", eff.gemm), ("memory efficiency", eff.memory)):
        if not 0 < v <= 1:
            raise PredictError(f"{name} {v} must be in (0, 1]")
    if eff.kernel_overhead_s < 0:
        raise PredictError("--kernel-overhead-us must be >= 0")
    for k, v in link_overrides.items():
        if v < 0 or (k == "bus_bytes_per_s" and v == 0):
            raise PredictError(f"link {k}={v} must be positive")
