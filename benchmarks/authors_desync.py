"""Desync Residual against the authors' inference model, numerically (CPU, float32).

    python benchmarks/authors_desync.py --authors-dir /tmp/authors [--tp 1,2] [--ladder-jax DIR]

`--authors-dir`: a checkout of github.com/mayank31398/ladder-residual-inference (nothing of it is
kept here). Random tiny weights from ladder_jax are converted to their gpt-fast layout (RoPE pairs
interleaved, fused w1 = [up; gate], one shard of heads and MLP units per rank) and run by their
GPTDesync at each tp (tp > 1: that many gloo processes on a loopback port) for each reduce
pattern: the presets every_layer, every_2_layers ("-4x"), final_only ("-infinite"), and all_sync
(every module syncing: the standard model, a check of the conversion). Their KV-cached greedy
loop's logits are compared with tests/desync_reference.py (float64) on the same tokens, and
their greedy tokens with the reference's. `--ladder-jax DIR`: a ladder_jax tree whose model has
residual="desync"; its logits and greedy tokens join the comparison (run there in a subprocess).
Prints max |logit diff| per pattern and tp, and greedy agreement. torch, jax and ladder_jax are
imported inside functions: the rank workers run torch alone, the ladder_jax one sets its devices.
"""

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 8  # prompt tokens per row
PATTERNS = ("every_layer", "every_2_layers", "final_only", "all_sync")


def _syncs(pattern, n_layers):
    from tests import desync_reference

    if pattern == "all_sync":
        return ((True, True),) * n_layers
    return desync_reference.resolve_pattern(pattern, n_layers)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: np.asarray(tree, np.float32)}


# ---- the authors' side (runs in the worker processes; torch only) ----------------------------


def _interleave(w, H):
    """Head-dim permutation from HF's rotate-half pairs (i, i + H/2) to adjacent pairs."""
    perm = np.stack([np.arange(H // 2), np.arange(H // 2) + H // 2], -1).reshape(-1)
    return w[..., perm]


def _rank_state(w, cfg, T, r, tied):
    """Their GPTDesync state dict for rank r of T from our flat weights."""
    N, K, F, H = cfg["n_heads"], cfg["n_kv_heads"], cfg["d_ff"], cfg["head_dim"]
    qh, kh = slice(r * N // T, (r + 1) * N // T), slice(r * K // T, (r + 1) * K // T)
    units = slice(r * F // T, (r + 1) * F // T)
    D = w["embed"].shape[1]
    sd = {
        "tok_embeddings.weight": w["embed"],
        "norm.weight": w["final_norm.scale"],
        "output.weight": w["embed"] if tied else w["head.weight"].T,
    }
    for i in range(cfg["n_layers"]):
        p = o = f"layers.{i}."
        q = _interleave(w[p + "attn.q.weight"][:, qh], H).reshape(D, -1)
        k = _interleave(w[p + "attn.k.weight"][:, kh], H).reshape(D, -1)
        v = w[p + "attn.v.weight"][:, kh].reshape(D, -1)
        sd[o + "attention.wqkv.weight"] = np.concatenate([q, k, v], 1).T
        sd[o + "attention.wo.weight"] = w[p + "attn.o.weight"][qh].reshape(-1, D).T
        up, gate = w[p + "mlp.up.weight"][:, units], w[p + "mlp.gate.weight"][:, units]
        sd[o + "feed_forward.w1.weight"] = np.concatenate([up, gate], 1).T
        sd[o + "feed_forward.w2.weight"] = w[p + "mlp.down.weight"][units].T
        sd[o + "attention_norm.weight"] = w[p + "attn_norm.scale"]
        sd[o + "ffn_norm.weight"] = w[p + "mlp_norm.scale"]
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def _import_authors(authors_dir):
    """gpt_fast.gpt_desync_TP without the package's other models (their ladder one needs
    triton) and with stand-ins for the CUDA-only kernel modules it imports but never calls
    here (flash attention is off; the RMSNorm stand-in is the plain formula)."""
    import torch

    class RMSNormFunction:
        @staticmethod
        def apply(x, weight, eps):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def unavailable(*_, **__):
        raise RuntimeError("flash attention is not available on CPU")

    stubs = {
        "flash_attn": dict(flash_attn_varlen_func=unavailable, flash_attn_with_kvcache=unavailable),
        "liger_kernel": {},
        "liger_kernel.ops": {},
        "liger_kernel.ops.rms_norm": dict(LigerRMSNormFunction=RMSNormFunction),
    }
    for name, attrs in stubs.items():
        sys.modules.setdefault(name, types.ModuleType(name)).__dict__.update(attrs)
    package = types.ModuleType("gpt_fast")
    package.__path__ = [str(Path(authors_dir) / "gpt_fast")]
    sys.modules["gpt_fast"] = package
    return importlib.import_module("gpt_fast.gpt_desync_TP")


def _authors_greedy(model, prompt, steps):
    """Their KV-cached loop: prefill, then one token per step; greedy. Returns the logits of
    every position of prompt + tokens[:-1] and the tokens."""
    import torch

    with torch.no_grad():
        P = prompt.shape[1]
        logits = [model(prompt, torch.arange(P))]
        tokens = [logits[-1][:, -1].argmax(-1)]
        for t in range(1, steps):
            logits.append(model(tokens[-1][:, None], torch.tensor([P + t - 1])))
            tokens.append(logits[-1][:, -1].argmax(-1))
    return torch.cat(logits, 1).numpy(), torch.stack(tokens, 1).numpy()


def _worker(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, T = args.rank, args.world
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=T
    )
    mod = _import_authors(args.authors_dir)
    work = Path(args.work)
    cfg = json.loads((work / "config.json").read_text())
    w = dict(np.load(work / "weights.npz"))
    prompt = torch.from_numpy(np.load(work / "prompt.npy"))
    state = {k: torch.from_numpy(v) for k, v in _rank_state(w, cfg, T, rank, cfg["tied"]).items()}
    out = {}
    for name in PATTERNS:
        pattern = [dict(attention=a, mlp=m) for a, m in cfg["patterns"][name]]
        margs = mod.ModelArgs(
            block_size=cfg["max_seq_len"],
            vocab_size=cfg["vocab_size"],
            n_layer=cfg["n_layers"],
            n_head=cfg["n_heads"],
            n_local_heads=cfg["n_kv_heads"],
            dim=w["embed"].shape[1],
            intermediate_size=cfg["d_ff"],
            rope_base=cfg["rope_theta"],
            norm_eps=cfg["norm_eps"],
            reduce_pattern=pattern,
        )
        model = mod.GPTDesync(margs)
        model.load_state_dict(state, strict=True)
        model.setup_caches(max_batch_size=prompt.shape[0], max_seq_length=cfg["max_seq_len"])
        out[f"{name}.logits"], out[f"{name}.tokens"] = _authors_greedy(model, prompt, args.steps)
    np.savez(work / f"tp{T}_rank{rank}.npz", **out)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_authors(args, work, T):
    """Their model at tp T: T worker processes; every rank's outputs."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--authors-dir", args.authors_dir]
            + ["--work", str(work), "--rank", str(r), "--world", str(T)]
            + ["--port", str(port), "--steps", str(args.steps)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(T)
    ]
    for r, p in enumerate(procs):
        log, _ = p.communicate(timeout=900)
        if p.returncode:
            sys.exit(f"error: the authors' model at tp {T}, rank {r} failed:\n{log[-3000:]}")
    return [dict(np.load(work / f"tp{T}_rank{r}.npz")) for r in range(T)]


# ---- ladder_jax's side (a subprocess with the given tree first on its path) -------------------


def _lj_worker(args):
    """ladder_jax's residual="desync" with desync_tp T on every mesh tp dividing T: logits on
    the authors' sequences and greedy tokens, for every T and pattern in the work folder."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    from flax import nnx

    import ladder_jax as lj

    print(f"ladder_jax from {Path(lj.__file__).parent}", flush=True)
    work = Path(args.work)
    cfg = json.loads((work / "config.json").read_text())
    want = dict(np.load(work / "weights.npz"))
    prompt = np.load(work / "prompt.npy")
    forward = nnx.jit(lambda m, t: m(t))
    out = {}
    for T in cfg["tps"]:
        seqs = dict(np.load(work / f"seqs_tp{T}.npz"))
        for mesh_tp in _mesh_tps(T):
            mesh = lj.make_mesh(tp=mesh_tp, data=1, devices=jax.devices()[:mesh_tp])
            config = lj.ModelConfig.from_preset("tiny", n_layers=cfg["n_layers"])
            model = lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(cfg["seed"]))
            got = _flatten(nnx.to_pure_dict(nnx.state(model)))
            assert all(np.array_equal(got[k], want[k]) for k in want), "weights differ"
            for name in PATTERNS:
                explicit = tuple(map(tuple, cfg["patterns"][name]))
                m = lj.with_config(
                    model,
                    residual="desync",
                    reduce_pattern=explicit if name == "all_sync" else name,
                    desync_tp=T,
                )
                key = f"tp{T}.mesh{mesh_tp}.{name}"
                out[key + ".logits"] = np.asarray(forward(m, seqs[name]))
                new = lj.generate(m, prompt, max_new_tokens=args.steps)
                out[key + ".tokens"] = np.asarray(new)
                print(f"ladder_jax desync_tp {T} on mesh tp {mesh_tp}: {name} done", flush=True)
    np.savez(work / "ladder_jax.npz", **out)


def _mesh_tps(T):
    """The mesh tp sizes ladder_jax runs desync_tp T on: every divisor of T (8 at most)."""
    return [t for t in range(1, min(T, 8) + 1) if T % t == 0]


def _run_ladder_jax(args, work):
    env = dict(os.environ, PYTHONPATH=str(Path(args.ladder_jax).resolve()))
    cmd = [sys.executable, __file__, "--lj-worker", "--authors-dir", args.authors_dir]
    cmd += ["--work", str(work), "--steps"]
    run = subprocess.run(
        cmd + [str(args.steps)], env=env, capture_output=True, text=True, timeout=1800
    )
    if run.returncode:
        sys.exit(f"error: ladder_jax in {args.ladder_jax} failed:\n{run.stderr[-3000:]}")
    print(run.stdout.strip().splitlines()[0])
    return dict(np.load(work / "ladder_jax.npz"))


# ---- the comparison ---------------------------------------------------------------------------


def _setup(args, work):
    """Random tiny weights (ladder_jax, tp 1), the prompt, the patterns; written to `work`."""
    import jax
    from flax import nnx

    import ladder_jax as lj

    config = lj.ModelConfig.from_preset("tiny", n_layers=args.layers)
    mesh = lj.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
    model = lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(args.seed))
    weights = nnx.to_pure_dict(nnx.state(model))
    np.savez(work / "weights.npz", **_flatten(weights))
    prompt = np.random.default_rng(args.seed).integers(0, config.vocab_size, (args.batch, PROMPT))
    np.save(work / "prompt.npy", prompt)
    patterns = {p: _syncs(p, config.n_layers) for p in PATTERNS}
    fields = ("vocab_size", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim")
    fields += ("max_seq_len", "rope_theta", "norm_eps")
    meta = {f: getattr(config, f) for f in fields} | dict(
        tied=config.tie_embeddings, patterns=patterns, seed=args.seed, tps=args.tp
    )
    (work / "config.json").write_text(json.dumps(meta))
    return weights, config, prompt, patterns


def _agree(a, b):
    return f"{int((a == b).sum())}/{a.size}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--authors-dir", required=True, help="ladder-residual-inference checkout")
    ap.add_argument("--ladder-jax", help="a ladder_jax tree with residual=desync to compare too")
    ap.add_argument("--tp", default="1,2", help="comma-separated tp sizes (default 1,2)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the tiny model (4)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="greedy tokens (8)")
    ap.add_argument("--seed", type=int, default=0)
    for flag in ("--worker", "--lj-worker"):
        ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in ("--work", "--rank", "--world", "--port"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.rank, args.world = int(args.rank), int(args.world)
        return _worker(args)
    if args.lj_worker:
        return _lj_worker(args)
    if not (Path(args.authors_dir) / "gpt_fast" / "gpt_desync_TP.py").is_file():
        ap.exit(2, f"error: no gpt_fast/gpt_desync_TP.py under --authors-dir {args.authors_dir}\n")
    args.tp = [int(t) for t in args.tp.split(",")]
    _compare(args)


def _compare(args):
    sys.path.insert(0, str(ROOT))
    from tests import desync_reference

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        weights, config, prompt, patterns = _setup(args, work)
        rows = {}
        for T in args.tp:
            print(f"the authors' GPTDesync at tp {T} ({T} process(es))...", flush=True)
            ranks = _run_authors(args, work, T)
            seqs = {}
            for name in PATTERNS:
                logits, tokens = ranks[0][f"{name}.logits"], ranks[0][f"{name}.tokens"]
                seqs[name] = np.concatenate([prompt, tokens[:, :-1]], 1)
                ref = desync_reference.forward(weights, config, seqs[name], T, patterns[name])
                ref_tokens = desync_reference.greedy(
                    weights, config, prompt, args.steps, T, patterns[name]
                )
                spread = max(np.abs(r[f"{name}.logits"] - logits).max() for r in ranks)
                rows[T, name] = dict(
                    authors=np.abs(logits - ref).max(),
                    ranks=spread,
                    greedy=_agree(tokens, ref_tokens),
                    ref=ref,
                    ref_tokens=ref_tokens,
                )
            np.savez(work / f"seqs_tp{T}.npz", **seqs)
        lj_out = _run_ladder_jax(args, work) if args.ladder_jax else None
    _report(args, rows, lj_out)


def _report(args, rows, lj_out):
    print(f"\ntiny model, {args.layers} layers, batch {args.batch}, prompt {PROMPT}, ", end="")
    print(f"{args.steps} greedy steps; max |logit diff| unless a count")
    head = "tp  pattern         authors-ref  ranks-spread  greedy(authors=ref)  ref-std(prompt)"
    if lj_out is not None:
        head += "  lj-ref (mesh tp 1/2/..)     greedy(lj=ref)"
    print(head)
    for (T, name), r in rows.items():
        line = f"{T:<3} {name:<15} {r['authors']:<12.2e} {r['ranks']:<13.2e} "
        effect = np.abs(r["ref"] - rows[T, "all_sync"]["ref"])[:, :PROMPT].max()
        line += f"{r['greedy']:<20} {effect:<12.3f}"
        if lj_out is not None:
            diffs, greedy = [], []
            for mesh_tp in _mesh_tps(T):
                key = f"tp{T}.mesh{mesh_tp}.{name}"
                diffs.append(f"{np.abs(lj_out[key + '.logits'] - r['ref']).max():.2e}")
                greedy.append(_agree(lj_out[key + ".tokens"], r["ref_tokens"]))
            line += f"  {'/'.join(diffs):<27} {'/'.join(dict.fromkeys(greedy))}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
