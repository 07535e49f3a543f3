"""Does the package compute the right numbers on a real GPU? Each check runs the same weights on
the GPU and on this host's CPU (jax's CPU backend, the reference) and prints one line:

- forward logits, float32, every residual scheme (the flash attention there: Pallas/Triton);
- forward logits, bfloat16 compute (the flash attention there: cuDNN) against the float32 CPU
  forward;
- the Triton small-M matmul (`decode_matmul="pallas"`) against XLA's matmul on the GPU;
- int8 weights (`quantize`): GPU against CPU, same int8 values;
- greedy KV-cached decoding (`lj.generate`): the GPU's tokens against the CPU's;
- one training step's loss and gradient norm (`jax.grad` of the model's loss): GPU against CPU.

Relative error = ||gpu - cpu|| / ||cpu||. Limits: float32 with `highest` matmul precision
1e-4 (the Pallas attention kernel's dots may run in TF32: 3e-3), bfloat16 against float32 3e-2.

    python benchmarks/gpu_check.py                  # on a GPU: a minute or two
    python benchmarks/gpu_check.py --dry-run        # CPU against CPU: checks the script

Exit status 1 if any check fails or errs (each error's traceback is printed), else 0.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import _gpu

RESULTS: list[tuple[str, str, str]] = []


def check(name: str):
    """Runs the decorated function at once; its (ok, figure) becomes a PASS / FAIL line, an
    exception an ERROR line with its traceback."""

    def run(fn):
        t0 = time.perf_counter()
        try:
            ok, figure = fn()
            status = "PASS" if ok else "FAIL"
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the rest
            traceback.print_exc()
            status, figure = "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        line = f"{status:5s} {name}: {figure} ({time.perf_counter() - t0:.1f} s)"
        print(line, flush=True)
        RESULTS.append((status, name, figure))
        return fn

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU against CPU (checks the script)")
    args = ap.parse_args(argv)
    if not _gpu.ready(args.dry_run):
        return 2

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import ladder_jax as lj
    from ladder_jax.model import quant
    from ladder_jax.model.attention import attention_kernel

    cpu = jax.devices("cpu")[0]
    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {dev.platform}: {dev.device_kind}; reference: {cpu.device_kind}"
    )
    mesh_dev = lj.make_mesh(tp=1, devices=[dev])
    mesh_cpu = lj.make_mesh(tp=1, devices=[cpu])
    rng = np.random.default_rng(0)
    B, T = 2, 64
    tokens = rng.integers(0, 320, (B, T)).astype(np.int32)
    few = tokens[:, :8]  # 16 rows: the Triton small-M matmul's case

    def config(**kw):
        base = dict(vocab_size=320, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=512)
        return lj.ModelConfig(**{**base, "max_seq_len": 256, **kw})

    def pair(cfg, *, int8=False):
        """The same weights on the device and on the CPU (copied, not re-drawn)."""
        ref = lj.Transformer(cfg, mesh=mesh_cpu, rngs=nnx.Rngs(0))
        dut = lj.Transformer(cfg, mesh=mesh_dev, rngs=nnx.Rngs(1))
        if int8:
            ref, dut = quant.quantize(ref), quant.quantize(dut)
        s_ref, s_dut = nnx.state(ref), nnx.state(dut)
        nnx.update(
            dut,
            jax.tree.map(lambda r, d: jax.device_put(np.asarray(r), d.sharding), s_ref, s_dut),
        )
        return dut, ref

    forward = nnx.jit(lambda m, t: m(t))

    def logits(model, toks):  # the model runs on its own mesh
        return np.asarray(forward(model, jnp.asarray(toks)), np.float64)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    hp = jax.default_matmul_precision("highest")
    for residual, extra in (
        ("standard", {}),
        ("parallel", {}),
        ("ladder", {}),
        ("ladder", {"ladder_layers": (2, 3)}),
        ("upper_bound", {}),
    ):
        name = residual + (" (upper 2 of 4)" if extra else "")

        @check(f"float32 forward, {name}, attention {attention_kernel(mesh_dev, jnp.float32, 32)}")
        def _():
            dut, ref = pair(config(residual=residual, **extra))
            with hp:
                e = rel(logits(dut, tokens), logits(ref, tokens))
            return e < 3e-3, f"rel err {e:.2e} (limit 3e-3)"

    bf16 = dict(dtype="bfloat16")

    @check(
        f"bfloat16 forward, ladder, attention {attention_kernel(mesh_dev, jnp.bfloat16, 32)}, "
        "against float32 on CPU"
    )
    def _():
        dut, _ = pair(config(residual="ladder", **bf16))
        _, ref = pair(config(residual="ladder"))
        with hp:
            e = rel(logits(dut, tokens), logits(ref, tokens))
        return e < 3e-2, f"rel err {e:.2e} (limit 3e-2)"

    for q in (False, True):

        @check(f"Triton small-M matmul against XLA's, bfloat16, {'int8' if q else 'bf16'} weights")
        def _():
            xla, _ = pair(config(residual="ladder", **bf16), int8=q)
            tri, _ = pair(config(residual="ladder", decode_matmul="pallas", **bf16), int8=q)
            e = rel(logits(tri, few), logits(xla, few))
            return e < 3e-2, f"rel err {e:.2e} over {few.size} rows (limit 3e-2)"

    @check("int8 weights, float32 compute, GPU against CPU")
    def _():
        dut, ref = pair(config(residual="ladder"), int8=True)
        with hp:
            e = rel(logits(dut, tokens), logits(ref, tokens))
        return e < 3e-3, f"rel err {e:.2e} (limit 3e-3)"

    for residual in ("standard", "ladder"):

        @check(f"greedy decode (KV cache), float32, {residual}: GPU tokens against CPU tokens")
        def _():
            dut, ref = pair(config(residual=residual))
            prompts = [list(map(int, tokens[0, :12])), list(map(int, tokens[1, :5]))]
            with hp:
                a = lj.generate(dut, prompts, max_new_tokens=24)
                b = lj.generate(ref, prompts, max_new_tokens=24)
            same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
            n = sum(len(r) for r in b)
            return a == b, f"{same}/{n} tokens equal"

    @check("training step (loss and gradient), float32, ladder: GPU against CPU")
    def _():
        dut, ref = pair(config(residual="ladder"))
        targets = np.roll(tokens, -1, axis=1)

        def loss(model, t, y):
            lg = model(t).astype(jnp.float32)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(lg), y[..., None], -1))

        grad = nnx.jit(nnx.value_and_grad(loss))
        out = {}
        with hp:
            for key, m in (("dev", dut), ("cpu", ref)):
                v, g = grad(m, jnp.asarray(tokens), jnp.asarray(targets))
                flat = np.concatenate(
                    [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g)]
                )
                out[key] = (float(v), flat)
        dl = abs(out["dev"][0] - out["cpu"][0])
        eg = rel(out["dev"][1], out["cpu"][1])
        return (
            dl < 1e-4 and eg < 3e-3
        ), f"loss {out['cpu'][0]:.5f} (|diff| {dl:.1e}), grad rel err {eg:.2e}"

    bad = [r for r in RESULTS if r[0] != "PASS"]
    print(f"gpu_check: {len(RESULTS) - len(bad)}/{len(RESULTS)} passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
