"""Peak memory and tokens/s of a SmolLM2-135M-shaped training step on CPU: ladder_jax's trainer
beside transformers' step (`benchmarks/hf_train_step.py --shape smollm2`), same shapes
(float32, 30 layers, d_model 576, vocabulary 49152, tied head, AdamW, batch 8 x 256 tokens).

    python benchmarks/train_memory.py                                  # defaults vs the fix
    python benchmarks/train_memory.py --jax "" --jax "loss_chunk=64" --rounds 2 --steps 4
    python benchmarks/train_memory.py --skip-hf --jax "LADDER_JAX_HOST_MALLOC=default"

Every run is a process of its own, and the runs alternate (round 1 runs every setting once,
then round 2 ...), so that a shared machine whose load drifts slows them alike. ladder_jax runs
`python -m ladder_jax.train` from random weights of SmolLM2's shapes on the embedded corpus
with the keys of each `--jax` (NAME=value words in capitals set its environment), evaluating
and saving a checkpoint at the end as a run does; its tokens/s is the median over the steps
after the first (which compiles). transformers' figure is the mean over its timed steps. Peak
RSS is the kernel's high-water mark of the whole process (start-up, compilation, evaluation
and checkpoint included), read when it exits. A run killed (out of memory) says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# SmolLM2-135M's shapes as train keys on top of the tiny preset (byte tokens < 49152)
SMOLLM2_KEYS = [
    "model.vocab_size=49152",
    "model.d_model=576",
    "model.n_layers=30",
    "model.n_heads=9",
    "model.n_kv_heads=3",
    "model.d_ff=1536",
    "model.head_dim=64",
    "model.tie_embeddings=true",
    "model.rope_theta=100000.0",
    "model.norm_eps=1e-5",
    "model.dtype=float32",
    "model.max_seq_len=8192",
]
# the settings this benchmark compares by default: the trainer's defaults, and the CPU fix
DEFAULT_JAX = ["", "loss_chunk=64 model.remat=matmuls mesh.data=1"]


def run_child(cmd: list[str], env: dict) -> tuple[int, int, str]:
    """(exit status, peak RSS in bytes, output) of `cmd` run to its end."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return proc.returncode, usage.ru_maxrss * 1024, out.read()


def jax_run(keys: str, args, workdir: str, i: int) -> dict:
    name = f"run{i}"
    cmd = [
        sys.executable,
        "-m",
        "ladder_jax.train",
        *SMOLLM2_KEYS,
        f"data.batch_size={args.batch}",
        f"data.seq_len={args.seq}",
        f"steps={args.steps + 1}",
        "eval_every=0",
        "ckpt_every=0",
        "eval_batches=1",
        "log_every=1",
        "progress=lines",
        "tensorboard=false",
        "keep=1",
        f"run_dir={workdir}",
        f"name={name}",
    ]
    env = dict(os.environ)
    for word in shlex.split(keys):  # NAME=value in capitals: the environment's
        if re.match(r"[A-Z_][A-Z0-9_]*=", word):
            env.update([word.split("=", 1)])
        else:
            cmd.append(word)
    rc, peak, out = run_child(cmd, env)
    row = {"system": "ladder_jax", "setting": keys or "(defaults)", "rc": rc, "peak_rss": peak}
    path = os.path.join(workdir, name, "metrics.jsonl")
    if rc == 0 and os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rows[1:])
        row["done"] = next((ln for ln in out.splitlines() if ln.startswith("done:")), None)
    else:
        row["error"] = out.strip().splitlines()[-1:] if out.strip() else []
    return row


def hf_run(args) -> dict:
    cmd = [
        sys.executable,
        os.path.join(HERE, "hf_train_step.py"),
        "--shape",
        "smollm2",
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        "1",
        "--json",
    ]
    rc, peak, out = run_child(cmd, dict(os.environ))
    row = {
        "system": "transformers",
        "setting": "LlamaForCausalLM (sdpa)",
        "rc": rc,
        "peak_rss": peak,
    }
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc == 0 and lines:
        row["tokens_per_s"] = json.loads(lines[-1])["tokens_per_s"]
    else:
        row["error"] = out.strip().splitlines()[-1:] if out.strip() else []
    return row


def describe(row: dict) -> str:
    killed = ", killed: out of memory?" if row["rc"] in (-9, 137) else ""
    tps = (
        f"{row['tokens_per_s']:7.1f} tokens/s"
        if "tokens_per_s" in row
        else f"failed (exit {row['rc']}{killed})"
    )
    return (
        f"{row['system']:<12} {row['setting']:<48} {tps}  peak RSS {row['peak_rss'] / 1e9:5.2f} GB"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--jax",
        action="append",
        default=None,
        metavar="KEYS",
        help="train keys of one ladder_jax setting, e.g. 'loss_chunk=64' ('': the "
        "defaults); repeat for several (default: the defaults and "
        f"{DEFAULT_JAX[1]!r})",
    )
    ap.add_argument("--rounds", type=int, default=1, help="times each setting runs")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true", help="ladder_jax settings only")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args(argv)
    settings = args.jax if args.jax is not None else DEFAULT_JAX
    rows = []
    with tempfile.TemporaryDirectory(prefix="train-memory-") as workdir:
        for r in range(args.rounds):
            runs = [("jax", k) for k in settings] + ([] if args.skip_hf else [("hf", None)])
            for j, (kind, keys) in enumerate(runs):
                row = jax_run(keys, args, workdir, r * 100 + j) if kind == "jax" else hf_run(args)
                row["round"] = r + 1
                rows.append(row)
                print(f"round {r + 1}: {describe(row)}", flush=True)
    print(
        f"medians over {args.rounds} round(s), batch {args.batch} x {args.seq} tokens, "
        f"{args.steps} timed steps per run:"
    )
    for key in dict.fromkeys((row["system"], row["setting"]) for row in rows):
        mine = [row for row in rows if (row["system"], row["setting"]) == key]
        ok = [row["tokens_per_s"] for row in mine if "tokens_per_s" in row]
        med = {
            "system": key[0],
            "setting": key[1],
            "rc": mine[-1]["rc"],
            "peak_rss": statistics.median(row["peak_rss"] for row in mine),
        }
        if ok:
            med["tokens_per_s"] = statistics.median(ok)
        print("  " + describe(med))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"batch": args.batch, "seq": args.seq, "steps": args.steps, "rows": rows},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
