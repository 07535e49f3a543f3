"""The decode step against the HBM roofline: bytes and kernels per layer of the compiled program,
against the least a step must move (its weight shards and the KV cache's filled slots, once).
What is counted: docs/analysis.md, 'The roofline report'.

    r = layer_report(config, Workload(tp=8, batch=1, prompt_len=1024, new_tokens=512))"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import shutil
import tempfile

from flax import nnx

from ladder_jax import hardware
from ladder_jax.analysis import programs
from ladder_jax.analysis.compiled import Workload, compiled_depths, decode_fill, program_kernels
from ladder_jax.analysis.tables import scheme_name
from ladder_jax.inference import generation
from ladder_jax.model.layout import device_bytes
from ladder_jax.model.linear import Linear
from ladder_jax.model.transformer import abstract, fuse_inputs


@functools.lru_cache(maxsize=64)
def layer_minimum(config, workload: Workload) -> dict:
    """Bytes one GPU must read per layer of a decode step: `weights_bytes` (layer 0's weights
    as decoding holds them, a replicated kv head counted once: the one the GPU reads) and
    `kv_cache_bytes` (the layer's K and V blocks of the slots the average step of the request
    has filled, prompt + new_tokens / 2: what the ragged attention reads, `decode_fill`; the
    request's own cache, whatever `slots` a server holds)."""
    w = dataclasses.replace(workload, slots=None)
    mesh = programs.gpu_mesh(w.target, w.tp, hosts=w.hosts)
    config = _one_layer(config)
    model = fuse_inputs(nnx.merge(*abstract(config, mesh)))
    layer = model.layers[0]
    weights = 0
    for _, node in nnx.iter_graph(layer):
        if not isinstance(node, Linear):
            continue
        share = node.kv_heads[0] if node.kv_heads else 1  # the rank reads one of its heads
        for v in (node.weight, node.scale):
            if v is not None:
                weights += device_bytes(v.get_value()) // share
    linear_ids = {
        id(v)
        for _, n in nnx.iter_graph(layer)
        if isinstance(n, Linear)
        for v in (n.weight, n.scale)
        if v is not None
    }
    for _, node in nnx.iter_graph(layer):  # norms and anything else not in a Linear
        if isinstance(node, nnx.Variable) and id(node) not in linear_ids:
            weights += device_bytes(node.get_value())
    cache = generation.KVCache.abstract(
        config, mesh, w.batch, generation.cache_length(config, w.prompt_len, w.new_tokens)
    )
    kv = device_bytes(cache.k[0]) + device_bytes(cache.v[0])
    kv = round(kv * decode_fill(config, w))
    return {"weights_bytes": weights, "kv_cache_bytes": kv}


def _one_layer(config):
    """`config` at one layer, for its weights: an explicit desync pattern (one pair per layer)
    becomes the named one, which holds the same weights."""
    explicit = isinstance(config.reduce_pattern, tuple)
    return dataclasses.replace(config, n_layers=1, **({"reduce_pattern": None} if explicit else {}))


def step_minimum(config, workload: Workload) -> int:
    """Bytes one GPU must read per decode step: every layer's minimum (`layer_minimum`), the
    final norm and the LM head's block (the tied embedding's vocab rows); an untied
    embedding's table is only gathered from, and is not counted."""
    per_layer = layer_minimum(config, workload)
    head = _head_bytes(config, workload.tp, workload.target, workload.hosts)
    return config.n_layers * (per_layer["weights_bytes"] + per_layer["kv_cache_bytes"]) + head


@functools.lru_cache(maxsize=64)
def _head_bytes(config, tp: int, target: str, hosts: int) -> int:
    mesh = programs.gpu_mesh(target, tp, hosts=hosts)
    model = nnx.merge(*abstract(_one_layer(config), mesh))
    out = (
        device_bytes(model.final_norm.scale.get_value())
        if hasattr(model.final_norm, "scale")
        else 0
    )
    if model.head is None:
        return out + device_bytes(model.embed.get_value())
    for v in (model.head.weight, model.head.scale):
        if v is not None:
            out += device_bytes(v.get_value())
    return out


def layer_report(config, workload: Workload, *, layers_compiled: int = 4) -> dict:
    """One decode program's layer against the roofline: `layer_bytes` (HBM bytes its kernels
    read and write), `layer_min_bytes`, `bytes_vs_minimum`, `kernels_per_layer` (compute
    kernels), `collectives_per_layer`, `step_bytes` (the whole step at full depth) and
    `layer_kernels` ((name, bytes) of the deepest compile's last layer's kernels). A layer is
    the difference of the depths `compiled_depths` compiles (`layers_compiled` and one period
    fewer, over the period),
    or, where it compiles the full depth only (`layers_compiled=0`, hybrid ladders), the step
    less its head (the minimum's `step_minimum` less `layer_minimum`s) over the layers:
    `per_layer` says which. The workload's `slots`: the cache's slots per row (a server's
    `--max-len`); the minimum stays the request's own cache, which is all the ragged attention
    should read. Compiles (or reads from the cache) the programs."""
    depths = compiled_depths(config, layers_compiled)
    progs = [
        program_kernels(dataclasses.replace(config, n_layers=d), workload, phase="decode")
        for d in depths
    ]
    compute = [[k for k in p.kernels if k.kind == "compute"] for p in progs]
    colls = [sum(k.kind in ("start", "sync") for k in p.kernels) for p in progs]
    total = [sum(k.nbytes for k in c) for c in compute]
    minimum = layer_minimum(config, workload)
    low = minimum["weights_bytes"] + minimum["kv_cache_bytes"]
    n = config.n_layers
    if len(depths) == 2:
        period = depths[1] - depths[0]  # a layer: the difference over one period, shared
        per = (lambda x: x) if period == 1 else (lambda x: x / period)  # noqa: E731
        nbytes, kernels = per(total[1] - total[0]), per(len(compute[1]) - len(compute[0]))
        collectives, per_layer = per(colls[1] - colls[0]), "difference"
        step = total[1] + (n - depths[1]) // period * (total[1] - total[0])
    else:
        head = step_minimum(config, workload) - n * low
        step = total[0]
        nbytes, kernels = (step - head) / n, len(compute[0]) / n
        collectives, per_layer = colls[0] / n, "step over layers"
    last = [(k.name, k.nbytes) for k in compute[-1] if k.layer == depths[-1] - 1]
    return {
        "layer_bytes": nbytes,
        "layer_min_bytes": low,
        "layer_weights_bytes": minimum["weights_bytes"],
        "layer_kv_cache_bytes": minimum["kv_cache_bytes"],
        "bytes_vs_minimum": nbytes / low,
        "kernels_per_layer": kernels,
        "collectives_per_layer": collectives,
        "step_bytes": step,
        "per_layer": per_layer,
        "layer_kernels": last,
    }


def roofline_fields(
    config,
    workload: Workload,
    *,
    layers_compiled: int,
    decode_step_s: float,
    calibration: hardware.Calibration | None = None,
) -> dict:
    """The report's fields of one `predict` row (docs/analysis.md#the-roofline-report): the
    layer's bytes and kernels (`layer_report`), the step's bytes and minimum, the roofline's
    step time (the minimum at the chip's HBM bandwidth) and `roofline_fraction`, that time over
    the predicted `decode_step_s`."""
    rep = layer_report(config, workload, layers_compiled=layers_compiled)
    chip = calibration.chip if calibration is not None else hardware.CHIPS[workload.target]
    low = step_minimum(config, workload)
    roof_s = low / chip.hbm_bytes_per_s
    return {
        "layer_bytes": rep["layer_bytes"],
        "layer_min_bytes": rep["layer_min_bytes"],
        "bytes_vs_minimum": rep["bytes_vs_minimum"],
        "kernels_per_layer": rep["kernels_per_layer"],
        "collectives_per_layer": rep["collectives_per_layer"],
        "step_bytes": rep["step_bytes"],
        "step_min_bytes": low,
        "roofline_step_s": roof_s,
        "roofline_fraction": roof_s / decode_step_s,
    }


def format_table(rows: list[dict]) -> str:
    """The roofline report of `predict` rows (one line per tp, batch and scheme)."""
    lines = [
        f"{'tp':>3} {'batch':>5} {'residual':<12} {'MB/layer':>9} {'minimum':>9} "
        f"{'x min':>6} {'kernels/layer':>13} {'roofline ms':>11} {'of roofline':>11}"
    ]
    seen = set()
    for r in sorted(rows, key=lambda r: (r["tp"], r["batch"])):
        key = (r["tp"], r["batch"], scheme_name(r), r["link"])
        if "layer_bytes" not in r or key[:3] in seen:
            continue
        seen.add(key[:3])
        lines.append(
            f"{r['tp']:>3} {r['batch']:>5} {key[2]:<12} "
            f"{r['layer_bytes'] / 1e6:>9.2f} {r['layer_min_bytes'] / 1e6:>9.2f} "
            f"{r['bytes_vs_minimum']:>5.2f}x {r['kernels_per_layer']:>13g} "
            f"{r['roofline_step_s'] * 1e3:>11.3f} {r['roofline_fraction']:>11.2f}"
        )
    return (
        "decode step vs the HBM roofline (per GPU; a layer = the compiled d minus d-1 "
        "layers; fraction: minimum bytes at the HBM bandwidth / predicted step)\n"
        + "\n".join(lines)
    )


def command_buffers(config, workload: Workload, *, options: dict | None = None) -> dict:
    """How the compiled decode step would launch on a GPU: XLA wraps runs of kernels into
    command buffers (CUDA graphs) after its thunk passes, which the scheduled HLO does not show;
    this compiles the step once more with XLA's dump and reads its thunk sequence.

        command_buffers(config, Workload(tp=8, batch=1, prompt_len=1024, new_tokens=512))

    Returns `graphs` (command buffers, each one launch), `graph_kernels` (kernels per graph,
    in order), `kernels_outside` (kernels launched one by one) and `collectives` (collective
    starts, which end a graph: collectives are not in XLA's default command buffer types).
    `options` are added to the package's GPU options (for experiments)."""
    w = workload
    mesh = programs.gpu_mesh(w.target, w.tp)
    lowered = programs.lower_decoder(
        config,
        mesh,
        phase="decode",
        batch=w.batch,
        prompt_len=w.prompt_len,
        new_tokens=w.new_tokens,
    )
    d = tempfile.mkdtemp(prefix="ladder_jax_thunks_")
    try:
        programs.compile_lowered(
            lowered,
            what=f"the decode program at tp={w.tp} on {w.target}",
            options={**(options or {}), "xla_dump_to": d},
        )
        found = {
            os.path.basename(p).rsplit(".", 2)[-2]: p
            for p in glob.glob(os.path.join(d, "*.thunk_sequence*.txt"))
        }
        # without a thunk pass to run (command buffers off) XLA dumps the sequence once
        path = found.get("thunk_sequence_after_thunk_passes", found.get("thunk_sequence"))
        if path is None:
            raise RuntimeError(f"XLA dumped no thunk sequence for the decode step in {d}")
        with open(path) as f:
            lines = f.read().splitlines()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    graphs, inside, top = [], False, []
    for line in lines:
        kind = re.match(r"(\s*)\d+: (\w+)", line)
        if not kind:
            continue
        if not kind.group(1):  # a top-level thunk
            inside = kind.group(2) == "kCommandBuffer"
            if inside:
                graphs.append(0)
            else:
                top.append(kind.group(2))
        elif inside and kind.group(2) in ("kCustomKernel", "kKernel", "kGemm", "kCublasLtMatmul"):
            graphs[-1] += 1
    return {
        "graphs": len(graphs),
        "graph_kernels": graphs,
        "kernels_outside": sum(
            k in ("kCustomKernel", "kKernel", "kGemm", "kCublasLtMatmul") for k in top
        ),
        "collectives": sum(k == "kAsyncStart" for k in top),
    }
