"""Prove the overlap: compile a model program for an NVIDIA GPU target on a machine with no GPU,
then read the scheduled HLO and report every all-reduce.

    python -m ladder_jax.overlap --preset llama-3-8b --tp 8 --phase decode
    python -m ladder_jax.overlap --preset tiny --residual standard --phase train --json

How it works. XLA's CUDA compiler runs on the CPU when given a description of the target chip
(`ladder_jax.hardware`, H100 / H200) through the CUDA PJRT plugin (`pip install -e ".[test]"` brings
it; no CUDA libraries, no GPU). The model is built from shapes only (`nnx.eval_shape`), so
`llama-3-70b` compiles on a laptop. The compiled module is scheduled: its ENTRY computation
lists kernels in execution order, and every async all-reduce appears as an
`all-reduce-start` / `all-reduce-done` pair. An all-reduce is *overlapped* when at least one
matmul kernel is scheduled between its start and done (and XLA did not mark it `is_sync`).

What counts as a matmul kernel: a cuBLAS custom-call, a Triton GEMM fusion (`gemm_fusion*`:
deviceless builds are not autotuned), a plain `dot`, or any fusion whose JAX op is a
`dot_general` (at one token per row XLA rewrites small matmuls into multiply-reduce fusions,
which are still the module's matmul work).

Attribution: the model runs each module under `jax.named_scope("layer{i}.{attn|mlp}")`, which
survives in the HLO metadata; ops of the backward pass carry `transpose(` in their name stack.
The all-reduce of module i is issued in module i's scope.

Phases are the programs users run. `prefill` and `decode` are `ladder_jax.decode.Decoder`'s
jitted prefill (a `--seq`-token prompt written into the KV cache, then sampling of the first
new token) and its one-token step (KV cache, attention over all its slots, sampling), with a
cache sized for `--seq` + `--new-tokens` as `decode` sizes it, and the decode CLI's sampling
(temperature 0.8, top-k 200). `train` is a full training step (forward, backward, AdamW
update) on `--seq` tokens.

The options the package compiles with (`ladder_jax.sharding.compiler_options("gpu")`) are
applied here exactly as in training and decoding: the report shows what users get.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
import time

from ladder_jax import hardware

PLUGIN_HINT = ('deviceless GPU compilation needs the CUDA PJRT plugin at the jax version in use: '
               'pip install "jax-cuda12-plugin=={v}" "jax-cuda12-pjrt=={v}"  '
               '(or: pip install -e ".[test]"); no GPU or CUDA libraries are needed')


class OverlapError(RuntimeError):
    pass


def gpu_mesh(target: str, tp: int):
    """A (data=1, tp) mesh of abstract GPUs of `target` (no GPU needed)."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    if target not in hardware.TARGETS:
        raise OverlapError(f"unknown target {target!r}: choose one of "
                           f"{', '.join(hardware.TARGETS)}")
    check_plugin()
    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=hardware.gpu_target_config(target),
            topology=f"1x1x{tp}")
    except Exception as e:  # the plugin's errors are plain RuntimeErrors
        raise OverlapError(f"could not describe {tp} x {target}: {e}\n"
                           + PLUGIN_HINT.format(v=jax.__version__)) from None
    devices = np.array(topo.devices).reshape(1, tp)
    return Mesh(devices, ("data", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))


def check_plugin() -> None:
    """Raises OverlapError with the install line when the CUDA PJRT plugin is missing."""
    import jax

    try:  # find_spec of a dotted name imports its parent: it raises when that is missing
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise OverlapError(PLUGIN_HINT.format(v=jax.__version__))


# ---------------------------------------------------------------------------------------------
# Programs, from shapes alone.

SAMPLING = dict(temperature=0.8, top_k=200)  # the decode CLI's defaults (the paper's protocol)


def _abstract(tree, mesh):
    """Variables of an `nnx.eval_shape` model as ShapeDtypeStructs in their shardings."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    return jax.tree.map(
        lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                 sharding=NamedSharding(mesh, v.spec))),
        tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def lower_decoder(config, mesh, *, phase: str, batch: int, prompt_len: int, new_tokens: int,
                  sampling=None):
    """The lowered `Decoder` prefill or one-token step (KV cache, sampling) of `config` on
    `mesh`, from shapes: the cache holds `prompt_len + new_tokens` (rounded as `decode` does)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ladder_jax import decode, sharding
    from ladder_jax.model import Transformer

    sampling = sampling or decode.Sampling(**SAMPLING)
    model = nnx.eval_shape(lambda: Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)))
    decoder = decode.Decoder(model, sampling)
    state = _abstract(decoder.state, mesh)
    tp = sharding.tp_size(mesh)
    S = decode.cache_length(config, prompt_len, new_tokens)
    kv = jax.ShapeDtypeStruct((batch, S, sharding.cache_kv_heads(config, tp), config.head_dim),
                              jnp.dtype(config.dtype),
                              sharding=NamedSharding(mesh, sharding.CACHE_BSKH))
    cache = [(kv, kv) for _ in range(config.n_layers)]
    rows = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=NamedSharding(mesh, P()))
    if phase == "prefill":
        tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32,
                                      sharding=NamedSharding(mesh, P("data", None)))
        return decoder._prefill.lower(state, cache, tokens, rows, key)
    return decoder._step.lower(state, cache, rows, rows, key)


def compile_program(config, *, phase: str, tp: int, batch: int, seq: int, target: str = "h100",
                    new_tokens: int = 512):
    """Compiles `phase` of `config` for `tp` GPUs of `target`; returns (hlo_text, seconds).
    `seq` is the prompt (prefill, decode) or training length; `new_tokens` sizes the decode
    cache."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ladder_jax import sharding, step
    from ladder_jax.model import Transformer

    if phase not in PHASES:
        raise OverlapError(f"unknown phase {phase!r}: choose one of {', '.join(PHASES)}")
    mesh = gpu_mesh(target, tp)
    sharding.check_divisible(config, tp)
    options = sharding.compiler_options("gpu")
    t0 = time.perf_counter()
    if phase in ("prefill", "decode"):
        lowered = lower_decoder(config, mesh, phase=phase, batch=batch, prompt_len=seq,
                                new_tokens=new_tokens)
        hlo = lowered.compile(compiler_options=options).as_text()
        return hlo, time.perf_counter() - t0
    abstract = nnx.eval_shape(lambda: Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    params = _abstract(params, mesh)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=NamedSharding(mesh, P()))
    optimizer = step.make_optimizer()
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(  # moments follow the params' shardings; counters replicated
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=getattr(
            s, "sharding", None) or NamedSharding(mesh, P())), opt_state)

    def train(params, opt_state, tokens):
        return step.train_step(graphdef, params, opt_state, tokens, tokens,
                               optimizer=optimizer)

    lowered = jax.jit(train, compiler_options=options, donate_argnums=(0, 1)).lower(
        params, opt_state, tokens)
    hlo = lowered.compile().as_text()
    return hlo, time.perf_counter() - t0


PHASES = ("prefill", "decode", "train")


# ---------------------------------------------------------------------------------------------
# Reading the schedule.

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+([\w\-$]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*)\[([\d,]*)\]")
_SCOPE = re.compile(r"layer(\d+)\.(attn|mlp|parallel)")


def _nbytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = 8 if dtype == "pred" else 16 if dtype == "bf16" else int(
            re.match(r"[a-z]+?(\d+)", dtype).group(1))
        size = max(1, bits // 8)
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * size
    return total


@dataclasses.dataclass
class _Op:
    name: str
    shape: str
    opcode: str
    text: str

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.text)
        return m.group(1) if m else ""

    def is_matmul(self) -> bool:
        if self.opcode in ("dot", "convolution"):
            return True
        if self.opcode == "custom-call":
            return bool(re.search(r'custom_call_target="__cu(blas|dnn)[^"]*', self.text))
        if self.opcode == "fusion":
            return (self.name.startswith(("gemm_fusion", "triton_gemm", "cublas"))
                    or "__triton_gemm" in self.text or self.op_name.endswith("dot_general"))
        return False


def _computations(hlo: str) -> dict[str, list[_Op]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        if current is None:
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if m and not line.startswith(" "):
                current = "ENTRY" if m.group(1) else m.group(2)
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(_Op(m.group(1), m.group(2), m.group(3), line))
    return comps


def read_all_reduces(hlo: str, d_model: int) -> list[dict]:
    """Every all-reduce of a scheduled HLO module, in schedule order (see the module doc).

    `kind` says what it reduces: `module` (a layer's attention / MLP output in the forward,
    its input cotangent in the backward: what the residual scheme is about), `head` (the LM
    head's input cotangent), `weight_grad` (gradient of a weight replicated over tp),
    `loss` (log-sum-exp and target logit over the vocab-sharded logits) or `optimizer`
    (scalar reductions such as the gradient norm).
    """
    if "is_scheduled=true" not in hlo.split("\n", 1)[0]:
        raise OverlapError("the HLO module is not scheduled: pass compiled, not lowered, text")
    found = []
    for cname, ops in _computations(hlo).items():
        for i, op in enumerate(ops):
            if op.opcode not in ("all-reduce-start", "all-reduce"):
                continue
            if op.opcode == "all-reduce":
                done, between, is_sync = op, [], True
            else:
                ref = re.compile(rf"%{re.escape(op.name)}\b")
                j = next(j for j in range(i + 1, len(ops))
                         if ops[j].opcode == "all-reduce-done" and ref.search(ops[j].text))
                done, between, is_sync = ops[j], ops[i + 1:j], '"is_sync":true' in op.text
            scope = _SCOPE.search(op.op_name)
            dims = [int(d) for d in (_ARRAY.search(done.shape).group(2) or "0").split(",") if d]
            activation = len(dims) == 3 and dims[-1] == d_model
            if "shard_map" not in op.op_name:
                kind = "loss" if len(dims) > 1 or "jvp(" in op.op_name else "optimizer"
            elif not activation:
                kind = "optimizer" if not dims else "weight_grad"
            else:
                kind = "module" if scope else "head" if "/head/" in op.op_name else "other"
            asynchronous = op.opcode == "all-reduce-start" and not is_sync
            gemms = sum(o.is_matmul() for o in between) if asynchronous else 0
            found.append({
                "pass": "backward" if "transpose(" in op.op_name else "forward",
                "kind": kind,
                "layer": int(scope.group(1)) if scope else None,
                "module": scope.group(2) if scope else None,
                "asynchronous": asynchronous,
                "gemms_between": gemms,
                "overlapped": gemms >= 1,
                "bytes": _nbytes(done.shape),
                "computation": cname,
                "op_name": op.op_name,
            })
    return found


def summarize(all_reduces: list[dict]) -> dict:
    """Totals, plus per pass over the all-reduces of the layers and head (kind module/head):
    `all_but_last_overlapped` is the ladder's promise for that pass."""
    out = {"total_all_reduces": len(all_reduces),
           "overlapped_all_reduces": sum(r["overlapped"] for r in all_reduces),
           "by_kind": {}}
    for r in all_reduces:
        k = out["by_kind"].setdefault(r["kind"], {"total": 0, "overlapped": 0})
        k["total"] += 1
        k["overlapped"] += r["overlapped"]
    for p in ("forward", "backward"):
        rs = [r for r in all_reduces if r["pass"] == p and r["kind"] in ("module", "head")]
        out[p] = {"total": len(rs), "overlapped": sum(r["overlapped"] for r in rs),
                  "all_but_last_overlapped": bool(rs) and all(r["overlapped"] for r in rs[:-1])}
    return out


def report(config, *, phase: str, tp: int, batch: int, seq: int, target: str = "h100",
           new_tokens: int = 512) -> dict:
    """Compile and read: the JSON-able report that `python -m ladder_jax.overlap` prints."""
    hlo, seconds = compile_program(config, phase=phase, tp=tp, batch=batch, seq=seq,
                                   target=target, new_tokens=new_tokens)
    ars = read_all_reduces(hlo, config.d_model)
    return {"preset_config": dataclasses.asdict(config), "residual": config.residual,
            "ladder_layers": config.ladder_layers, "phase": phase, "tp": tp, "batch": batch,
            "seq": seq, "target": target,
            "compile_seconds": round(seconds, 2), **summarize(ars), "all_reduces": ars}


def format_table(rep: dict) -> str:
    lines = [f"{'#':>3} {'pass':<8} {'kind':<11} {'layer':>5} {'module':<8} {'sync?':<6} "
             f"{'GEMMs between':>13} {'bytes':>12}"]
    for i, r in enumerate(rep["all_reduces"]):
        layer = "-" if r["layer"] is None else r["layer"]
        lines.append(f"{i:>3} {r['pass']:<8} {r['kind']:<11} {layer:>5} {r['module'] or '-':<8} "
                     f"{'async' if r['asynchronous'] else 'sync':<6} {r['gemms_between']:>13} "
                     f"{r['bytes']:>12,}")
    return "\n".join(lines)


def verdict(rep: dict) -> str:
    parts = []
    for p in ("forward", "backward"):
        s = rep[p]
        if s["total"]:
            tail = " (all but the last)" if s["all_but_last_overlapped"] and s["total"] > 1 else ""
            parts.append(f"{p} {s['overlapped']}/{s['total']}{tail}")
    others = {k: v for k, v in rep["by_kind"].items() if k not in ("module", "head")}
    other = "".join(f"; {k}: {v['overlapped']}/{v['total']}" for k, v in sorted(others.items()))
    ll = f" ladder_layers={rep['ladder_layers']}" if rep["ladder_layers"] is not None else ""
    return (f"{rep['residual']}{ll} {rep['phase']} tp={rep['tp']} on {rep['target']}: layer "
            f"all-reduces overlapping a matmul: {', '.join(parts)}{other}; compiled in "
            f"{rep['compile_seconds']:.1f}s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ladder_jax.overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--residual", default="ladder",
                   choices=["standard", "parallel", "ladder", "upper_bound"])
    p.add_argument("--ladder-layers", default=None,
                   help="ladder only: N (upper N layers) or a comma list of layer indices")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024, help="prompt / training length")
    p.add_argument("--new-tokens", type=int, default=512,
                   help="decode: new tokens the KV cache has room for (default 512)")
    p.add_argument("--phase", default="decode", choices=PHASES)
    p.add_argument("--target", default="h100", choices=hardware.TARGETS)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_platforms", "cpu")  # compile for the GPU target, run nothing
    from ladder_jax.model import ConfigError, ModelConfig
    from ladder_jax.sharding import ShardingError

    try:
        ll = args.ladder_layers
        if ll is not None:
            ll = int(ll) if ll.isdigit() else tuple(int(x) for x in ll.split(",") if x)
        config = ModelConfig.from_preset(args.preset, residual=args.residual, ladder_layers=ll)
        rep = report(config, phase=args.phase, tp=args.tp, batch=args.batch, seq=args.seq,
                     target=args.target, new_tokens=args.new_tokens)
    except (ConfigError, ShardingError, OverlapError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        rep.pop("preset_config")
        print(json.dumps({"preset": args.preset, **rep}))
    else:
        print(format_table(rep))
        print(verdict(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
