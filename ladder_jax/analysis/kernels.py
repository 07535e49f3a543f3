"""Reading the scheduled program: one `Kernel` per ENTRY instruction that takes time on a GPU,
with the HBM bytes and FLOPs of a compute kernel, or a collective's message bytes, ranks and
hosts. What is counted: docs/analysis.md, 'Predict the speed-up'.

    kernels = read_kernels(hlo_text, devices=8)"""

from __future__ import annotations

import dataclasses
import math
import re

from ladder_jax.analysis import hlo
from ladder_jax.model import ragged


class PredictError(ValueError):
    """Arguments the model cannot run with; the message says what to use instead."""


# ---------------------------------------------------------------------------------------------
# Reading the scheduled program: one Kernel per entry that takes time.


@dataclasses.dataclass(frozen=True)
class Kernel:
    """`kind`: compute (a kernel on the compute stream), start / done (an async collective:
    `name` pairs them), sync (a collective that blocks both streams). `nbytes` is what a
    compute kernel moves through HBM, or the collective's message size; a collective runs over
    `ranks` GPUs on `hosts` hosts."""

    kind: str
    name: str
    flops: float = 0.0
    nbytes: float = 0.0
    collective: str = ""
    layer: int | None = None
    ranks: int = 1
    hosts: int = 1
    tiles: int = 0  # a GEMM's thread-block tiles (`gemm_tiles`; 0: not known)
    strategy: str = ""  # a collective's kernel: "one_shot", "two_shot" (XLA's), "" (NCCL)


_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "after-all",
    "add-dependency",
    "domain",
    "iota",
}
_SLICES = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # operand 0 updated in place: the update


def _flops(module: hlo.Module, comp: str) -> float:
    """FLOPs of the dots of `comp` and of the computations its fusions call."""
    total = 0.0
    for op in module.computations.get(comp, ()):
        if op.opcode == "dot":
            lhs = module.op(comp, op.operands[0]).dims
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.text)
            contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i)
            total += 2.0 * op.elements * contracted
        elif op.opcode == "fusion":
            total += _flops(module, module.called(op))
    return total


def _fusion_cost(module: hlo.Module, op: hlo.Op) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of an ENTRY fusion."""
    comp = module.called(op)
    body = module.computations[comp]
    flops = _flops(module, comp)
    if not flops and op.op_name.endswith("dot_general"):  # a matmul as multiply-reduce
        flops = 2.0 * max(o.elements for o in body)
    users: dict[str, list] = {}
    for o in body:
        for pos, name in enumerate(o.operands):
            users.setdefault(name, []).append((o, pos))
    params = {
        int(re.search(r"parameter\((\d+)\)", o.text).group(1)): o
        for o in body
        if o.opcode == "parameter"
    }
    nbytes = 0.0
    for k, name in enumerate(op.operands):
        uses = _through_bitcasts(params[k].name, users)
        if uses and all(u.opcode in _SLICES and pos == 0 for u, pos in uses):
            nbytes += sum(hlo.nbytes(u.shape) for u, _ in uses)
        elif uses and all(u.opcode in _IN_PLACE and pos == 0 for u, pos in uses):
            pass  # the buffer updated in place: only the update moves (counted as output)
        else:
            nbytes += hlo.nbytes(module.op("ENTRY", name).shape)
    root = next(o for o in body if o.is_root)
    outs = [module.op(comp, n) for n in root.operands] if root.opcode == "tuple" else [root]
    for o in outs:
        while o.opcode == "bitcast":
            o = module.op(comp, o.operands[0])
        if o.opcode in _IN_PLACE:  # the update: a dynamic-update-slice's 1, a scatter's 2
            nbytes += hlo.nbytes(module.op(comp, o.operands[_IN_PLACE[o.opcode]]).shape)
        else:
            nbytes += hlo.nbytes(o.shape)
    return flops, nbytes


def _plain_cost(module: hlo.Module, op: hlo.Op, filled: float = 1.0) -> tuple[float, float]:
    """(FLOPs, bytes) of a non-fusion kernel: operands in, result out. The decode step's
    ragged attention (`ladder_jax.model.ragged`) reads only the `filled` fraction of its
    cache operands, the last two: operands queries, positions, keys, values
    (`attend_filled`), or the q/k/v rows, positions, RoPE frequencies, keys, values
    (`attend_new`), whose cache outputs alias those operands and write one slot each. The
    rows operand counts at the q/k/v columns the kernel reads: the parallel scheme hands it
    its whole five-way projection, whose gate and up columns it leaves unread."""
    entry = [module.op("ENTRY", n) for n in op.operands]
    sizes = [hlo.nbytes(o.shape) if o is not None else 0 for o in entry]
    out_bytes = hlo.nbytes(op.shape)
    flops = 0.0
    if op.opcode == "custom-call" and ragged.KERNEL_NAME in op.text and len(sizes) in (4, 5):
        caches, sizes[-2:] = sizes[-2:], [filled * n for n in sizes[-2:]]
        B_, K_, H_, S_ = entry[-2].dims  # keys (B, K, H, S)
        queries = entry[0].elements  # (B, K, M, H) or rows (B, C), C >= (N + 2K) H
        if len(sizes) == 5:
            # the output (B, K, G, H), or its splits' partials (B, K, splits, G, H): N = K G
            queries = B_ * K_ * op.dims[-2] * H_
            sizes[0] *= (queries + 2 * B_ * K_ * H_) / entry[0].elements  # q/k/v columns
            out_bytes += sum(n / S_ - n for n in caches)  # updated in place: the new slot
        # two products of the queries with the slots read
        flops = 4.0 * queries * S_ * filled
    nbytes = sum(sizes) + out_bytes
    if op.opcode == "custom-call" and re.search(r'custom_call_target="__cublas', op.text):
        lhs = entry[0].dims
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', op.text)
        idx = [int(i) for i in re.findall(r"\d+", m.group(1))] if m else [len(lhs) - 1]
        flops = 2.0 * op.elements * math.prod(lhs[i] for i in idx)
    elif op.opcode == "custom-call" and "xla.gpu.triton" in op.text and not flops:
        flops = _flash_flops(op.op_name, entry)
    return flops, nbytes


def _flash_flops(op_name: str, operands: list) -> float:
    """FLOPs of a flash-attention kernel of this package's (jax's Pallas / Triton attention,
    always causal): q (B, T, H, D) and k (B, S, H, D) are its first two operands; the forward
    does 2 matmuls of 2·B·H·T·S·D each, the backward 5 (scores recomputed, dV, dP, dQ, dK), both
    over the causal fraction of the T x S scores (the kernel skips the blocks above the
    diagonal). Other Triton kernels (the backward's preprocessing) count none."""
    scope = op_name.rsplit("/", 2)[-2] if "/" in op_name else ""
    matmuls = (
        2 if scope == "mha_forward" else 5 if scope in ("mha_backward", "jvp(mha_backward)") else 0
    )
    if not matmuls or len(operands) < 2 or any(o is None or len(o.dims) != 4 for o in operands[:2]):
        return 0.0
    (b, t, h, d), s = operands[0].dims, operands[1].dims[1]
    if t > s:
        return 0.0
    causal = (t * (s - t) + t * (t + 1) / 2) / (t * s)  # query i sees s - t + i + 1 keys
    return matmuls * 2.0 * b * h * t * s * d * causal


def gemm_tiles(op: hlo.Op) -> int:
    """Thread-block tiles of a Triton GEMM fusion, from its backend config: the product over
    the output's dimensions of ceil(dim / tile) for the `output_tiles` of its block-level
    config (trailing dimensions; leading ones without a tile size count one tile per index),
    or batch x ceil(M / block_m) x ceil(N / block_n) x split_k for a `triton_gemm_config`.
    0 where the HLO does not say (a cuBLAS call, any other kernel).

        gemm_tiles(op)  # f32[256,512] with output_tiles sizes [64, 128]: 4 * 4 = 16
    """
    dims = op.dims
    m = re.search(r'"output_tiles":\[\{"sizes":\[([^\]]*)\]', op.text)
    if m and re.search(r'"kind":"__triton\w*gemm', op.text):
        sizes = [int(x) for x in re.findall(r"\d+", m.group(1))]
        if not sizes or len(sizes) > len(dims) or 0 in sizes:
            return 0
        lead = dims[: len(dims) - len(sizes)]
        tail = dims[len(dims) - len(sizes) :]
        return math.prod(lead) * math.prod(-(-d // t) for d, t in zip(tail, sizes))
    m = re.search(r'"triton_gemm_config":\{([^}]*)\}', op.text)
    if m and len(dims) >= 2:
        cfg = dict(re.findall(r'"(\w+)":"?(\d+)"?', m.group(1)))
        bm, bn, split = (int(cfg.get(k, 0)) for k in ("block_m", "block_n", "split_k"))
        if bm and bn:
            *batch, rows, cols = dims
            return math.prod(batch) * -(-rows // bm) * -(-cols // bn) * max(split, 1)
    return 0


def _collective_bytes(module: hlo.Module, op: hlo.Op) -> float:
    """Message size: the larger of what goes in and what comes out."""
    entry = [module.op("ENTRY", n) for n in op.operands]
    inputs = sum(hlo.nbytes(o.shape) for o in entry if o is not None)
    total = hlo.nbytes(op.shape)
    outputs = total - inputs if op.opcode.endswith("-start") and total > inputs else total
    return float(max(inputs, outputs))


def _through_bitcasts(name, users) -> list:
    out = []
    for u, pos in users.get(name, ()):
        out += _through_bitcasts(u.name, users) if u.opcode == "bitcast" else [(u, pos)]
    return out


def read_kernels(
    text: str,
    *,
    devices: int = 1,
    gpus_per_host: int | None = None,
    filled: float = 1.0,
    allreduce: str = "nccl",
) -> list[Kernel]:
    """The ENTRY computation of a scheduled module as Kernels, in schedule order. A
    collective's ranks and hosts come from its replica group (device ids numbered host by host,
    `gpus_per_host` each; no group: all `devices`). `filled`: the fraction of the KV cache's
    slots a decode step's ragged attention reads (`decode_fill`). `allreduce`: how the
    program was compiled to run its all-reduces; with "one_shot" each takes the kernel XLA
    annotated it with (`Kernel.strategy`). XLA annotates every all-reduce by its size whether
    the program runs its kernels or not (the HLO is the same), so with "nccl" all run on NCCL."""
    try:
        module = hlo.Module(text)
    except hlo.HloError as e:
        raise PredictError(str(e)) from None
    per_host = gpus_per_host or max(devices, 1)
    kernels, sync = [], set()
    for op in module.entry:
        code = op.opcode
        if code in _FREE:
            continue
        collective = module.collective(op)
        if code.endswith("-done") and code != "copy-done":
            start = op.operands[0]
            if start not in sync:
                kernels.append(Kernel("done", start, layer=op.layer))
            continue
        if collective and (code.endswith("-start") or code == collective):
            kind = "sync" if code == collective or op.is_sync else "start"
            if kind == "sync":
                sync.add(op.name)
            group = op.replica_group or list(range(devices))
            kernels.append(
                Kernel(
                    kind,
                    op.name,
                    nbytes=_collective_bytes(module, op),
                    collective=collective,
                    layer=op.layer,
                    ranks=len(group),
                    hosts=len({d // per_host for d in group}),
                    strategy=op.kernel_strategy if allreduce == "one_shot" else "",
                )
            )
        elif code.endswith("-start") and code != "copy-start":  # an async op of no known kind
            kind = "sync" if op.is_sync else "start"
            if kind == "sync":
                sync.add(op.name)
            kernels.append(
                Kernel(
                    kind,
                    op.name,
                    nbytes=_collective_bytes(module, op),
                    collective="other",
                    layer=op.layer,
                    ranks=devices,
                )
            )
        else:
            flops, nbytes = (
                _fusion_cost(module, op) if code == "fusion" else _plain_cost(module, op, filled)
            )
            tiles = gemm_tiles(op) if flops and code == "fusion" else 0
            kernels.append(Kernel("compute", op.name, flops, nbytes, layer=op.layer, tiles=tiles))
    return kernels
