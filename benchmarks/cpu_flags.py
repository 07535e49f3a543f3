"""XLA:CPU's options against this machine's training step: which of XLA's CPU kernel paths
(its own emitters, oneDNN, XNNPACK, YNNPACK), vector widths and math modes makes the `small`
training step fastest here, with the same work as `benchmarks/hf_train_step.py` (the HF
transformers peer). Prints the CPU, its vector extensions and jax's version first, so that two
machines' figures can be compared, then one row per option set: tokens/s (median step) and the
ratio to XLA's defaults (the `default` set: the package's options for every program, without
the training-step ones, which the `ynn-dot` set holds).

    python benchmarks/cpu_flags.py                  # every option set, 8 interleaved rounds
    python benchmarks/cpu_flags.py --rounds 4 --sets default xnn-dot

Each option set is its own compile of the same lowered step (options passed per program, so
nothing else in the process changes); the steps are interleaved, one of each in turn, so load
that drifts slows them alike. An option this jaxlib does not accept is reported and skipped.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

# name -> XLA:CPU debug options added to the package's own (ladder_jax.model.sharding)
SETS = {
    "default": {},
    "xnn-dot": {"xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "xnn-dot-eltwise": {
        "xla_cpu_experimental_xnn_fusion_type": (
            "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"
        )
    },
    "xnn-graph": {"xla_cpu_experimental_xnn_graph_fusion_mode": "XNN_GRAPH_FUSION_MODE_GREEDY"},
    # what the package's training steps use (sharding.CPU_TRAIN_OPTIONS)
    "ynn-dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    # no YNNPACK fusions at all (this jaxlib fuses dots into YNNPACK by default): Eigen's dots
    "no-ynn": {"xla_cpu_experimental_ynn_fusion_type": ""},
    # XLA:CPU's scheduler orders the program for running independent ops at once (its
    # default); off: a memory-minimizing order
    "sequential": {"xla_cpu_enable_concurrency_optimized_scheduler": False},
    "ynn-dot+sequential": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
        "xla_cpu_enable_concurrency_optimized_scheduler": False,
    },
    # Eigen's dots on one thread each: the parallelism left is XLA running independent ops at
    # once (the step's concurrent dots otherwise share the threads of both)
    "no-ynn+1-thread-dots": {
        "xla_cpu_experimental_ynn_fusion_type": "",
        "xla_cpu_multi_thread_eigen": False,
    },
    "ynn-dot+1-thread-dots": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
        "xla_cpu_multi_thread_eigen": False,
    },
    "ynn-individual-dot": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
    },
    "ynn-individual-dot+1-thread-dots": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
        "xla_cpu_multi_thread_eigen": False,
    },
    "ynn-dot+fast-runtime": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
        "xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_RUNTIME",
    },
    "ynn-dot+memory-scheduler": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
        "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    },
    "ynn-dot+1-thread-dots+sequential": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
        "xla_cpu_multi_thread_eigen": False,
        "xla_cpu_enable_concurrency_optimized_scheduler": False,
    },
    "ynn-dot+1-thread-dots+xla-barriers": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
        "xla_cpu_multi_thread_eigen": False,
        "xla_disable_hlo_passes": "",
    },
    # how XLA:CPU emits its own fusions (the step's layout-changing elementwise fusions, which
    # feed the weight-gradient matmuls transposed, are among its slowest kernels)
    "loop-emitters": {"xla_cpu_use_fusion_emitters": False},
    "tiling-propagation": {"xla_cpu_experimental_enable_tiling_propagation": True},
    "onednn-dot": {"xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "onednn": {"xla_cpu_use_onednn": True},
    "vector-512": {"xla_cpu_prefer_vector_width": 512},
    "fast-math": {"xla_cpu_enable_fast_math": True},
    # the package keeps optimization barriers through XLA:CPU's fusion (sharding.py explains
    # why: the ladder's backward); this set lets XLA expand them as it does by default
    "xla-barriers": {"xla_disable_hlo_passes": ""},
    "ynn-dot+xla-barriers": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
        "xla_disable_hlo_passes": "",
    },
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds after one warm-up")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--shape",
        default="small",
        choices=("small", "smollm2"),
        help="the small preset, or SmolLM2-135M's shapes with the trainer's CPU settings for "
        "them (loss_chunk=64, model.remat=matmuls; train_memory.py); each set holds a copy of "
        "the weights and AdamW state (1.6 GB at smollm2): give a few --sets",
    )
    ap.add_argument(
        "--keys",
        nargs="+",
        default=[],
        help="more train keys (key=value), e.g. model.dtype=bfloat16",
    )
    args = ap.parse_args(argv)

    import jax
    import jaxlib
    import numpy as np

    import ladder_jax as lj  # first: it imports jax without the CUDA plugin's start-up lines
    from ladder_jax import train_config
    from ladder_jax.model import sharding
    from ladder_jax.train.trainer import Trainer

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from train_memory import SMOLLM2_KEYS

    shape_keys = [*SMOLLM2_KEYS, "loss_chunk=64", "model.remat=matmuls"]
    cfg = train_config.load_config(
        [
            os.path.join(here, "..", "configs", "tiny.yaml"),
            "model.preset=small",
            *(shape_keys if args.shape == "smollm2" else []),
            "model.residual=standard",
            f"data.seq_len={args.seq}",
            f"data.batch_size={args.batch}",
            "mesh.tp=1",
            "mesh.data=1",
            "run_dir=" + os.path.join(os.environ.get("TMPDIR", "/tmp"), "ladder_jax_cpu_flags"),
            *args.keys,
        ]
    )
    lj.runtime.setup(cpu_devices=1)
    trainer = Trainer(cfg)
    print(f"cpu: {lj.hardware.cpu_description()}")
    print(
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, python "
        f"{platform.python_version()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    print(
        f"step: {args.shape} shapes, float32, batch "
        f"{args.batch} x {args.seq} tokens, AdamW, clipping, {' '.join(args.keys)}; "
        f"{args.rounds} interleaved rounds"
    )
    state = trainer.state
    train_step = trainer.compiled_step(trainer.graphdef, state)[0]  # the step the trainer jits
    batches = [trainer.global_batch(next(trainer.data_iter)) for _ in range(2)]
    lowered = train_step.lower(state.params, state.opt_state, batches[0])
    base = sharding.compiler_options("cpu")  # without the training options: the sets add them
    runs = {}
    for name in args.sets:
        try:
            compiled = lowered.compile(compiler_options={**base, **SETS[name]})
        except Exception as e:  # an option this jaxlib does not know, or a bad value
            print(f"  {name:<20} not accepted here: {str(e).strip().splitlines()[0][:120]}")
            continue
        copy = jax.tree.map(lambda x: x.copy(), (state.params, state.opt_state))
        runs[name] = [compiled, copy, []]

    def one(name, i):
        compiled, (params, opt), times = runs[name]
        t0 = time.perf_counter()
        params, opt, metrics = compiled(params, opt, batches[i % 2])
        float(np.asarray(metrics["loss"]))
        times.append(time.perf_counter() - t0)
        runs[name][1] = (params, opt)

    for i in range(args.rounds + 1):
        for name in runs:
            one(name, i)
    tokens = args.batch * args.seq
    ref = None
    for name, (_, _, times) in runs.items():
        dt = float(np.median(times[1:]))
        ref = ref or (dt if name == "default" else None)
        ratio = f"{ref / dt:.2f}x" if ref else "-"
        opts = " ".join(f"--{k}={v}" for k, v in SETS[name].items()) or "(XLA's defaults)"
        spread = f"{min(times[1:]) * 1e3:.0f}-{max(times[1:]) * 1e3:.0f}"
        print(
            f"  {name:<20} {tokens / dt:>8,.0f} tokens/s  {dt * 1e3:>8.1f} ms/step "
            f"({spread:>9})  {ratio:>6}  {opts}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
