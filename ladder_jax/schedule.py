"""Deviceless GPU programs and their schedules: compile a model program for an NVIDIA GPU target
on a machine with no GPU, then read the scheduled HLO (every all-reduce, every other
collective, memory). The command line is `python -m ladder_jax.overlap`; the performance model
(`ladder_jax.perfmodel`) reads the same schedules.

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

Phases are the programs users run. `prefill` and `decode` are `ladder_jax.generation.Decoder`'s
jitted prefill (a `--seq`-token prompt written into the KV cache, then sampling of the first
new token) and its one-token step (KV cache, attention over all its slots, sampling), with a
cache sized for `--seq` + `--new-tokens` as `decode` sizes it, and the decode CLI's sampling
(temperature 0.8, top-k 200). `train` is a full training step (forward, backward, AdamW
update) on `--seq` tokens.

Training configs (`--config configs/X.yaml [key=value ...] --hosts N`): compiles the training
step that config runs (`compile_train_config`: its mesh, FSDP, dtypes, accumulation, remat and
optimizer, through the same `ladder_jax.step` functions the trainer uses) for N hosts of
`--gpus-per-host` GPUs: the plugin's topology `1 x N x G`, the (data, tp) mesh filled row by
row so that a tp group is one host. The report adds every other collective (`read_collectives`:
FSDP's all-gathers and reduce-scatters over `data`, the loss's and gradient norm's
all-reduces; counted per mesh axis and per place, inside the accumulation loop or once per
step) and the memory per device (`ladder_jax.step.memory_use`) against the chip's capacity; a
step that does not fit exits 2 with the fix (`ladder_jax.step.check_memory`, the check the
trainer makes on a GPU).

    python -m ladder_jax.overlap --config configs/llama-3-70b.yaml --hosts 8

The options the package compiles with (`ladder_jax.sharding.compiler_options("gpu")`) are
applied here exactly as in training and decoding: the report shows what users get.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import time

from ladder_jax import hardware

PLUGIN_HINT = ('deviceless GPU compilation needs the CUDA PJRT plugin at the jax version in use: '
               'pip install "jax-cuda12-plugin=={v}" "jax-cuda12-pjrt=={v}"  '
               '(or: pip install -e ".[test]"); no GPU or CUDA libraries are needed')


class OverlapError(RuntimeError):
    pass


def gpu_devices(target: str, n: int, *, hosts: int = 1) -> list:
    """`n` abstract GPUs of `target` on `hosts` hosts (n / hosts each), process by process: the
    plugin's topology `1 x hosts x n/hosts` (one slice). No GPU needed."""
    import jax
    from jax.experimental import topologies

    if target not in hardware.TARGETS:
        raise OverlapError(f"unknown target {target!r}: choose one of "
                           f"{', '.join(hardware.TARGETS)}")
    if hosts <= 0 or n <= 0 or n % hosts:
        raise OverlapError(f"{n} GPUs cannot be spread evenly over {hosts} hosts")
    check_plugin()
    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=hardware.gpu_target_config(target),
            topology=f"1x{hosts}x{n // hosts}")
    except Exception as e:  # the plugin's errors are plain RuntimeErrors
        raise OverlapError(f"could not describe {hosts} hosts x {n // hosts} {target}: {e}\n"
                           + PLUGIN_HINT.format(v=jax.__version__)) from None
    return list(topo.devices)


def gpu_mesh(target: str, tp: int, *, data: int = 1, hosts: int = 1):
    """A (data, tp) mesh of abstract GPUs of `target` on `hosts` hosts (no GPU needed). Devices
    fill the mesh row by row, so a tp group is tp consecutive GPUs: one host when tp <= the
    GPUs per host."""
    from jax.sharding import AxisType, Mesh

    devices = gpu_devices(target, data * tp, hosts=hosts)
    import numpy as np
    return Mesh(np.array(devices).reshape(data, tp), ("data", "tp"),
                axis_types=(AxisType.Auto, AxisType.Auto))


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


def lower_decoder(config, mesh, *, phase: str, batch: int, prompt_len: int, new_tokens: int,
                  sampling=None):
    """The lowered `Decoder` prefill or one-token step (KV cache, sampling) of `config` on
    `mesh`, from shapes: the cache holds `prompt_len + new_tokens` (rounded as `decode` does)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ladder_jax import generation, sharding
    from ladder_jax.model import abstract

    sampling = sampling or generation.Sampling(**SAMPLING)
    decoder = generation.Decoder(nnx.merge(*abstract(config, mesh)), sampling)
    state = decoder.state  # weights as ShapeDtypeStructs in their shardings
    tp = sharding.tp_size(mesh)
    S = generation.cache_length(config, prompt_len, new_tokens)
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
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ladder_jax import sharding, step
    from ladder_jax.model import abstract

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
    graphdef, params = abstract(config, mesh)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=NamedSharding(mesh, P()))
    optimizer = step.make_optimizer()
    # moments stored like their params, counters replicated (`jax.eval_shape` drops the
    # shardings: moments left replicated would put the whole model's AdamW state on every GPU,
    # and past XLA's memory limit the scheduler stops overlapping collectives)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_state,
        step.opt_state_shardings(optimizer, opt_state, params, mesh))

    def train(params, opt_state, tokens):
        return step.train_step(graphdef, params, opt_state, tokens, tokens,
                               optimizer=optimizer)

    lowered = jax.jit(train, compiler_options=options, donate_argnums=(0, 1)).lower(
        params, opt_state, tokens)
    hlo = lowered.compile().as_text()
    return hlo, time.perf_counter() - t0


PHASES = ("prefill", "decode", "train")


def compile_train_config(cfg, *, hosts: int = 1, gpus_per_host: int = 8, target: str = "h100"):
    """Compiles the training step that `cfg` (a TrainConfig) runs, for `hosts` x
    `gpus_per_host` GPUs of `target`: its mesh (`mesh.data` x `mesh.tp`, data filling what tp
    leaves), its weights stored as the trainer stores them (FSDP
    included), its dtypes, optimizer, gradient accumulation (`data.grad_accum` micro-batches of
    `data.batch_size` x `data.seq_len`) and rematerialization, the step function the trainer
    jits (`step.make_train_step`) with the same options. Returns (compiled, mesh, seconds)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ladder_jax import config as config_lib
    from ladder_jax import sharding, step
    from ladder_jax.model import abstract

    model_config = config_lib.check(cfg)
    n = hosts * gpus_per_host
    tp = cfg.mesh.tp
    if cfg.mesh.data is not None and cfg.mesh.data * tp != n:
        raise OverlapError(f"mesh.data={cfg.mesh.data} x mesh.tp={tp} = {cfg.mesh.data * tp} "
                           f"GPUs, but {hosts} hosts x {gpus_per_host} = {n}: set --hosts or "
                           f"mesh.data")
    if n % tp:
        raise OverlapError(f"mesh.tp={tp} does not divide the {n} GPUs")
    data = n // tp
    mesh = gpu_mesh(target, tp, data=data, hosts=hosts)
    sharding.check_batch(cfg.data.batch_size, mesh)
    graphdef, params = abstract(model_config, mesh, fsdp=cfg.mesh.fsdp)  # stored as trained
    optimizer = step.make_optimizer(cfg.optim, total_steps=cfg.steps)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             opt_state, step.opt_state_shardings(optimizer, opt_state, params,
                                                                 mesh))
    batch = jax.ShapeDtypeStruct(
        (cfg.data.grad_accum, cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32,
        sharding=NamedSharding(mesh, P(None, sharding.DATA, None)))
    train_step = step.make_train_step(
        graphdef, optimizer=optimizer, grad_clip=cfg.optim.grad_clip,
        param_shardings=[x.sharding for x in jax.tree.leaves(params)],
        opt_shardings=[x.sharding for x in jax.tree.leaves(opt_state)])
    t0 = time.perf_counter()
    compiled = sharding.jit(train_step, platform="gpu", donate_argnums=(0, 1)).lower(
        params, opt_state, batch).compile()
    return compiled, mesh, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Reading the schedule.

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

    @property
    def arguments(self) -> str:
        """The text after `opcode(`: the operands, then `)` and the attributes."""
        after_shape = _HEAD.match(self.text).end() + len(self.shape)
        start = self.text.index(self.opcode + "(", after_shape) + len(self.opcode) + 1
        return self.text[start:]

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
        op = _parse_instruction(line)
        if op:
            comps[current].append(op)
    return comps


_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-$]+)\(")


def _parse_instruction(line: str) -> _Op | None:
    """`name = shape opcode(...)`; a tuple shape is matched by its parentheses (it may hold
    `/*index=5*/` comments and nested tuples)."""
    m = _HEAD.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        depth = 0
        for end, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rest[:end + 1], rest[end + 1:]
    else:
        shape, _, rest = rest.partition(" ")
        rest = " " + rest
    o = _OPCODE.match(rest)
    return _Op(m.group(1), shape, o.group(1), line) if o else None


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
            dims = [int(d) for d in _ARRAY.search(done.shape).group(2).split(",") if d]
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


COLLECTIVES = ("all-gather", "reduce-scatter", "all-to-all", "collective-permute", "all-reduce")


def _iota(dims: list[int], perm: list[int] | None):
    import numpy as np
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def _first_group(text: str) -> list[int] | None:
    """The device ids of the first replica group of a collective, from any of XLA's spellings:
    `{{0,1},{2,3}}`, `[2,2]<=[4]` (iota, optionally transposed `T(1,0)`), or
    `mesh['axis_0'=2,'axis_1'=4](, device_ids=(...))? {'axis_0'}` (groups along the named axes of
    a device mesh)."""
    import numpy as np

    m = re.search(r"replica_groups=\{\{([\d,]*)\}", text)
    if m:
        return [int(x) for x in m.group(1).split(",") if x]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        ids = _iota([int(x) for x in m.group(3).split(",")],
                    [int(x) for x in m.group(4).split(",")] if m.group(4) else None)
        return ids.reshape(int(m.group(1)), int(m.group(2)))[0].tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                  r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", text)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        n = int(np.prod(sizes))
        ids = (_iota([int(x) for x in m.group(2).split(",")],
                     [int(x) for x in m.group(3).split(",")] if m.group(3) else None)
               if m.group(2) else np.arange(n)).reshape(sizes)
        along = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        index = tuple(slice(None) if i in along else 0 for i in range(len(sizes)))
        return ids[index].reshape(-1).tolist()
    return None


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
    """Every collective of a scheduled HLO module (all-gather, reduce-scatter, all-to-all,
    collective-permute, all-reduce), in schedule order, with the mesh axis it runs over (`tp`,
    `data` or `all` of a (data, tp) mesh), its bytes (the result, per device), where it sits
    (`loop`: inside a while loop's body, e.g. once per accumulated micro-batch; `step`: once
    per step) and whether it is overlapped (asynchronous, with a matmul scheduled between its
    start and done, as in `read_all_reduces`)."""
    if "is_scheduled=true" not in hlo.split("\n", 1)[0]:
        raise OverlapError("the HLO module is not scheduled: pass compiled, not lowered, text")
    comps = _computations(hlo)
    bodies = set()
    for ops in comps.values():
        for op in ops:
            if op.opcode == "while":
                bodies.update(re.findall(r"body=%?([\w.\-]+)", op.text))
    found = []
    for cname, ops in comps.items():
        for i, op in enumerate(ops):
            base = op.opcode[:-len("-start")] if op.opcode.endswith("-start") else op.opcode
            if base not in COLLECTIVES:
                continue
            if op.opcode == base:
                done, between, asynchronous = op, [], False
            else:
                ref = re.compile(rf"%{re.escape(op.name)}\b")
                j = next((j for j in range(i + 1, len(ops)) if ops[j].opcode == base + "-done"
                          and ref.search(ops[j].text)), None)
                if j is None:
                    continue
                done, between = ops[j], ops[i + 1:j]
                asynchronous = '"is_sync":true' not in op.text
            gemms = sum(o.is_matmul() for o in between) if asynchronous else 0
            found.append({
                "collective": base, "axis": _mesh_axis(_first_group(op.text), data, tp),
                "bytes": _nbytes(done.shape), "where": "loop" if cname in bodies else "step",
                "asynchronous": asynchronous, "gemms_between": gemms, "overlapped": gemms >= 1,
                "computation": cname, "op_name": op.op_name,
            })
    return found


def summarize_collectives(collectives: list[dict]) -> list[dict]:
    """One row per (collective, axis, where): count, overlapped count, total bytes."""
    rows = {}
    for c in collectives:
        key = (c["collective"], c["axis"], c["where"])
        r = rows.setdefault(key, {"collective": key[0], "axis": key[1], "where": key[2],
                                  "count": 0, "overlapped": 0, "bytes": 0})
        r["count"] += 1
        r["overlapped"] += c["overlapped"]
        r["bytes"] += c["bytes"]
    return list(rows.values())


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


def report_config(cfg, *, hosts: int = 1, gpus_per_host: int = 8, target: str = "h100") -> dict:
    """Compile the training step of `cfg` (`compile_train_config`) and read it: the module
    all-reduces (`read_all_reduces`), every other collective (`read_collectives`) and the
    per-device memory (`step.memory_use`) against the target's capacity. JSON-able."""
    from ladder_jax import config as config_lib
    from ladder_jax import step

    compiled, mesh, seconds = compile_train_config(cfg, hosts=hosts,
                                                   gpus_per_host=gpus_per_host, target=target)
    model = config_lib.model_config(cfg)
    hlo = compiled.as_text()
    data, tp = mesh.shape["data"], mesh.shape["tp"]
    ars = read_all_reduces(hlo, model.d_model)
    collectives = read_collectives(hlo, data=data, tp=tp)
    memory = step.memory_use(compiled)
    capacity = hardware.CHIPS[target].memory_bytes
    d = cfg.data
    return {"config": cfg.name, "preset": cfg.model.preset, "residual": model.residual,
            "ladder_layers": model.ladder_layers, "remat": model.remat, "phase": "train",
            "hosts": hosts, "gpus": hosts * gpus_per_host, "data": data, "tp": tp,
            "fsdp": cfg.mesh.fsdp, "batch": d.batch_size, "grad_accum": d.grad_accum,
            "seq": d.seq_len, "tokens_per_step": d.batch_size * d.grad_accum * d.seq_len,
            "target": target, "compile_seconds": round(seconds, 2),
            "memory": memory, "peak_bytes_per_device": memory["peak"],
            "device_memory_bytes": capacity, "fits": memory["peak"] <= capacity,
            **summarize(ars), "collectives": summarize_collectives(collectives),
            "all_reduces": ars}


def format_memory(rep: dict) -> str:
    m, gib = rep["memory"], 1024**3
    parts = [f"arguments {m['arguments'] / gib:.2f} (weights, optimizer state, batch)",
             f"outputs {m['outputs'] / gib:.2f} ({m['aliased'] / gib:.2f} in place)",
             f"temporaries {m['temporaries'] / gib:.2f}"]
    return (f"memory per device, GiB: {', '.join(parts)}; peak {m['peak'] / gib:.2f} of "
            f"{rep['device_memory_bytes'] / gib:.2f} ({rep['target']})"
            + ("" if rep["fits"] else ": DOES NOT FIT"))


def format_collectives(rep: dict) -> str:
    lines = [f"{'collective':<19} {'axis':<5} {'where':<5} {'count':>6} {'overlapped':>10} "
             f"{'MiB':>10}"]
    for r in rep["collectives"]:
        lines.append(f"{r['collective']:<19} {r['axis']:<5} {r['where']:<5} {r['count']:>6} "
                     f"{r['overlapped']:>10} {r['bytes'] / 2**20:>10.2f}")
    return "\n".join(lines)


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
