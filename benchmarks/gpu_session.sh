#!/usr/bin/env bash
# Every GPU check of the package in one run, most important first, within a deadline:
#   1. gpu_check.py: the numbers on the GPU against jax's CPU backend (every scheme, cuDNN and
#      Pallas attention, the Triton small-M matmul, int8, KV-cached decoding, a training step);
#   2. calibrate_gpu.py: GEMM rate, HBM bandwidth and kernel overhead measured, then llama-3-8b
#      at tp 1 decoded and set beside `predict`'s figure for it (tokens/s, ms per token);
#   3. python -m ladder_jax.decode --benchmark, llama-3-8b, every scheme, bf16 and int8;
#   4. decode_matmul.py: XLA's matmul against the Triton small-M kernel, per layer and end to end;
#   5. paged_attention.py: the server's paged decode kernel against the row kernel (the same
#      rows gathered) and the XLA page loop, checked and timed;
#   6. python -m ladder_jax.train configs/tiny.yaml on the GPU and on the CPU (final losses).
#
#   bash benchmarks/gpu_session.sh [DEADLINE_S]      # default 440 s; logs under $OUT or /tmp
#   DRY=1 bash benchmarks/gpu_session.sh 900         # CPU: checks the script (small sizes)
#
# Each step gets min(its own limit, the time left); a step past its limit is stopped and the
# next one runs. Every step's output goes to STEP.log, the figures to JSON files, all of them
# packed into session.tgz after every step (so a run stopped from outside still brings them
# back); the last lines printed are the summary. Python packages the machine lacks may lie as
# wheels in .whl/ (installed into /tmp/site first), e.g. for a Python 3.12 image whose jax is
# not the pinned one:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl flax==0.12.8 \
#     orbax-checkpoint==0.12.8 grain==0.2.18 array-record==0.8.6 omegaconf==2.4.0 \
#     antlr4-python3-runtime==4.13.2 portpicker
set -u
DEADLINE=${1:-440}
START=$(date +%s)
OUT=${OUT:-/tmp/gpu_session_out}
W=$(mktemp -d)
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" != 1 ] && ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$W/wheels.log" 2>&1 || echo "wheels: install failed"
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
DRY_ARG=""
if [ "${DRY:-0}" = 1 ]; then DRY_ARG="--dry-run"; fi

left() { echo $(( DEADLINE - ($(date +%s) - START) )); }

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 t0 rc l
  shift 2
  l=$(left)
  if [ "$l" -lt 20 ]; then
    echo "$name: skipped (${l} s left)" | tee -a "$W/summary.txt"
    return
  fi
  [ "$limit" -gt "$l" ] && limit=$l
  t0=$(date +%s)
  echo "== $name (limit ${limit} s): $*" > "$W/$name.log"
  timeout -k 5 "$limit" "$@" >> "$W/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$W/summary.txt"
  tar czf "$OUT/session.tgz" -C "$W" . 2> /dev/null
}

{
  date -u
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1
  $PY -c "import sys, jax, flax, optax, orbax.checkpoint as oc; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())" 2>&1
} > "$W/env.log"
cat "$W/env.log"

cd benchmarks
step gpu_check 150 $PY gpu_check.py $DRY_ARG
step calibrate 150 $PY calibrate_gpu.py $DRY_ARG --out "$W/calibration.json"
cd ..
if [ -n "$DRY_ARG" ]; then
  DEC=(--preset tiny --prompt-len 32 --max-new-tokens 8)
else
  DEC=(--preset llama-3-8b --prompt-len 1024 --max-new-tokens 64)
fi
step decode_bf16 120 $PY -m ladder_jax.decode --benchmark "${DEC[@]}" --residual all --json
step decode_int8 60 $PY -m ladder_jax.decode --benchmark "${DEC[@]}" --residual ladder \
  --quantize int8 --json
step decode_pallas 60 $PY -m ladder_jax.decode --benchmark "${DEC[@]}" --residual ladder \
  --decode-matmul pallas --json
cd benchmarks
step decode_matmul 100 $PY decode_matmul.py $DRY_ARG --tp 1 8 --repeats 10 \
  --out "$W/decode_matmul.json"
step paged_attention 60 $PY paged_attention.py $DRY_ARG --out "$W/paged_attention.json"
cd ..
TRAIN=(configs/tiny.yaml steps=60 log_every=20 eval_every=0 ckpt_every=0 progress=lines)
step train_gpu 60 $PY -m ladder_jax.train "${TRAIN[@]}" run_dir="$W/runs" name=gpu
step train_cpu 60 env JAX_PLATFORMS=cpu $PY -m ladder_jax.train "${TRAIN[@]}" \
  run_dir="$W/runs" name=cpu

echo "---- results"
grep -h -E "^(PASS|FAIL|ERROR) |gpu_check:" "$W/gpu_check.log" 2> /dev/null
grep -h -E "TFLOP|measured" "$W/calibrate.log" 2> /dev/null
$PY - "$W" <<'PYEOF'
import json, pathlib, sys
w = pathlib.Path(sys.argv[1])
for name in ("decode_bf16", "decode_int8", "decode_pallas", "decode_matmul"):
    f = w / f"{name}.log"
    if not f.exists():
        continue
    for line in f.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "decode_ms_per_token" in r:
            print(f"{name}: {r['preset']} {r['residual']} {r.get('quantize') or 'bf16'} "
                  f"{r.get('decode_matmul', '')} b{r['batch']}: {r['decode_ms_per_token']:.3f} "
                  f"ms/token, {r['tokens_per_s']:.1f} tok/s, roofline "
                  f"{r['roofline_fraction']:.3f} of {r['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, "
                  f"prefill {r['prefill_ms']:.1f} ms")
        elif "xla_us" in r:
            print(f"{name}: tp{r['tp']} {r['linear']} {r['quantize']} b{r['batch']}: xla "
                  f"{r['xla_gb_per_s']:.0f} GB/s, pallas {r['pallas_gb_per_s']:.0f} GB/s, "
                  f"max diff {r['max_abs_diff']:.2g}")
PYEOF
for s in train_gpu train_cpu; do echo "$s: $(tail -n 2 "$W/$s.log" 2> /dev/null)"; done
echo "---- steps"
cat "$W/summary.txt"
echo "total $(( $(date +%s) - START )) s; logs in $OUT/session.tgz"
rm -rf "$W/runs"
tar czf "$OUT/session.tgz" -C "$W" . 2> /dev/null
