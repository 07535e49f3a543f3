"""The paged Triton decode-attention kernel (`paged_kernel.attend_paged`) on one GPU: checked
against the row cache's Triton kernel over the same keys and values, and timed beside it and
beside the XLA page loop.

    python benchmarks/paged_attention.py --out paged_attention.json       # a few minutes
    python benchmarks/paged_attention.py --dry-run --out /tmp/pa.json     # CPU: checks the script

llama-3-8b's attention on one GPU at tp 1 (8 kv heads of 4 query heads, head_dim 128,
bfloat16), batch 1 and 16, a decode step (T 1) and a verify step (T 5), rows filled to 1,024,
4,096 and 8,192 positions of tables of 512 pages scattered over the pool at random. For each:
- paged: `paged_kernel.attend_paged` over the pool;
- rows: `ragged.attend_filled(kernel="pallas")` over the same rows gathered into a row cache;
- xla: `paged.attend(kernel="matmul")`, the XLA page loop;
each timed as `--calls` calls in one program (each on other queries), best of `--repeats`: us
a call and the filled keys' and values' bytes a second. The check: paged against rows,
relative error of the outputs (limit 1e-2: bfloat16 outputs, other summation orders). Exit 1
if a check fails. `--dry-run`: the kernels interpreted on CPU at small sizes (figures
meaningless; the file says so). Without a GPU and without `--dry-run`: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _gpu

LIMIT = 1e-2


def _inputs(B, T, K, G, H, M, page, length, seed=0):
    """Queries, pools of B * M + 1 pages (page 0 the trash page), tables of M pages permuted at
    random (entries past `length` positions: trash), positions length - T ... length - 1."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    P = B * M + 1
    table = rng.permutation(np.arange(1, P)).reshape(B, M).astype(np.int32)
    table[:, -(-length // page) :] = 0
    pos_bt = np.broadcast_to(length - T + np.arange(T, dtype=np.int32), (B, T))

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)

    q = normal(B, T, K * G, H)
    return q, normal(P, K, H, page), normal(P, K, page, H), jnp.asarray(table), jnp.asarray(pos_bt)


def _calls(attend, n: int):
    """`attend(q, ...)` n times in one program, each call on other queries (q + i / 64), the
    outputs summed (so no call is hoisted out of the loop or dropped)."""
    import jax
    import jax.numpy as jnp

    def run(q, *rest):
        def body(i, acc):
            out = attend((q + (i / 64).astype(q.dtype)).astype(q.dtype), *rest)
            return acc + out.astype(jnp.float32)

        return jax.lax.fori_loop(0, n, body, jnp.zeros(q.shape, jnp.float32))

    return jax.jit(run)


def measure(*, batches, steps, lengths, shape, calls: int, repeats: int, interpret: bool) -> list:
    import numpy as np

    from ladder_jax.model import paged, paged_kernel, ragged

    K, G, H, M, page = shape
    rows = []
    for B in batches:
        for T in steps:
            for length in lengths:
                q, k_pool, v_pool, table, pos_bt = _inputs(B, T, K, G, H, M, page, length)
                S = M * page
                k_rows = k_pool[table].transpose(0, 2, 3, 1, 4).reshape(B, K, H, S)
                v_rows = v_pool[table].transpose(0, 2, 1, 3, 4).reshape(B, K, S, H)
                forms = {
                    "paged": (
                        lambda q, k, v, t, p: paged_kernel.attend_paged(
                            q, k, v, t, p, interpret=interpret
                        ),
                        (k_pool, v_pool, table, pos_bt),
                    ),
                    "rows": (
                        lambda q, k, v, p: ragged.attend_filled(
                            q, k, v, p, kernel="pallas", interpret=interpret
                        ),
                        (k_rows, v_rows, pos_bt),
                    ),
                    "xla": (
                        lambda q, k, v, t, p: paged.attend(q, k, v, t, p, kernel="matmul"),
                        (k_pool, v_pool, table, pos_bt),
                    ),
                }
                kv_bytes = 2 * B * K * length * H * 2  # the filled keys and values, bf16
                row = {"batch": B, "T": T, "length": length, "kv_bytes": kv_bytes}
                outs = {}
                for name, (attend, rest) in forms.items():
                    outs[name] = np.asarray(_calls(attend, 1)(q, *rest), np.float64)
                    program = _calls(attend, calls)
                    s = _gpu.best(lambda p=program, r=rest: p(q, *r), repeats) / calls
                    row[f"{name}_us"] = s * 1e6
                    row[f"{name}_gb_per_s"] = kv_bytes / s / 1e9
                for name in ("rows", "xla"):
                    err = np.linalg.norm(outs["paged"] - outs[name]) / np.linalg.norm(outs[name])
                    row[f"rel_err_vs_{name}"] = float(err)
                row["ok"] = bool(row["rel_err_vs_rows"] < LIMIT) and bool(
                    np.isfinite(outs["paged"]).all()
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--out", default="paged_attention.json", help="JSON file to write")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 5], help="tokens a row (T)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="None: 1024 4096 8192")
    ap.add_argument("--calls", type=int, default=20, help="calls a timed program makes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="CPU, small sizes: checks the script")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not _gpu.ready(dry):
        return 2
    import jax

    # (kv heads, query heads a kv head, head_dim, pages a table, positions a page)
    shape = (2, 4, 16, 8, 16) if dry else (8, 4, 128, 512, 16)
    t0 = time.perf_counter()
    rows = measure(
        batches=[2] if dry else args.batch,
        steps=args.steps,
        lengths=args.lengths or ([40, 128] if dry else [1024, 4096, 8192]),
        shape=shape,
        calls=2 if dry else args.calls,
        repeats=1 if dry else args.repeats,
        interpret=dry,
    )
    out = {
        "device": jax.devices()[0].device_kind,
        "dry_run": dry,
        "note": "DRY RUN on a CPU: interpreted kernels, figures meaningless" if dry else "",
        "shape": dict(zip(("kv_heads", "group", "head_dim", "pages", "page"), shape)),
        "limit": LIMIT,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    bad = [r for r in rows if not r["ok"]]
    print(
        f"paged_attention: {len(rows) - len(bad)}/{len(rows)} checks passed -> {args.out} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
