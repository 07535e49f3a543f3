"""Dump the model's numbers to an .npz, to check a refactor changes none of them (exactly).

    python benchmarks/bit_identity.py --out /tmp/before.npz      # on the unchanged tree
    python benchmarks/bit_identity.py --out /tmp/after.npz --compare /tmp/before.npz

What it records, on 8 fake CPU devices, tiny preset, seed 0, one fixed batch: the loss and
every gradient of a training step for each scheme (standard, parallel, ladder, a hybrid
ladder, upper_bound) at tp 1 and tp 4 x data 2, plus ladder and parallel under
`remat=module`, ladder with FSDP, ladder at tp 8 (replicated kv heads); greedy decode tokens
(float, and int8) for a few prompts; logits of int8 forwards; cached decode logits
(prefill, then one step) per scheme. Array names are weight paths with a trailing "/weight"
dropped, so a weight that moves into a `Linear` compares with its old self.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import ladder_jax as lj  # noqa: E402
from ladder_jax.inference import generation  # noqa: E402
from ladder_jax.inference.cache import KVCache  # noqa: E402
from ladder_jax.model import quant  # noqa: E402
from ladder_jax.train import step  # noqa: E402

TINY = lj.ModelConfig.from_preset("tiny")
SCHEMES = {
    "standard": dict(residual="standard"),
    "parallel": dict(residual="parallel"),
    "ladder": dict(residual="ladder"),
    "hybrid": dict(residual="ladder", ladder_layers=2),
    "upper_bound": dict(residual="upper_bound"),
}
PROMPTS = [[5, 17, 99, 3, 250, 7, 8], [11, 12], [300, 1, 2, 3]]


def mesh(tp, data=1):
    return lj.make_mesh(tp=tp, data=data, devices=jax.devices()[: tp * data])


def name(path) -> str:
    parts = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if parts and parts[-1] == "weight":
        parts = parts[:-1]
    return "/".join(parts)


def flat(tree) -> dict:
    return {name(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def train_step(out, tag, config, tp, data, fsdp=False):
    m = mesh(tp, data)
    graphdef, params = nnx.split(lj.Transformer(config, mesh=m, rngs=nnx.Rngs(0), fsdp=fsdp))
    tokens = jax.random.randint(jax.random.key(3), (4, 33), 0, config.vocab_size)
    fn = jax.jit(lambda p, t: step.loss_and_grads(graphdef, p, t[:, :-1], t[:, 1:]))
    loss, grads = fn(params, tokens)
    out[f"train/{tag}/loss"] = np.asarray(loss)
    for k, v in flat(nnx.to_pure_dict(grads)).items():
        out[f"train/{tag}/grad/{k}"] = v


def model(tp, **changes):
    return lj.Transformer(dataclasses.replace(TINY, **changes), mesh=mesh(tp), rngs=nnx.Rngs(0))


def decode(out, tag, mdl, consume=False):
    decoder = generation.Decoder(mdl, consume=consume) if consume else None
    tokens = generation.generate(mdl, PROMPTS, max_new_tokens=8, decoder=decoder)
    for i, row in enumerate(tokens):
        out[f"decode/{tag}/{i}"] = np.asarray(row, np.int32)


def cached_logits(out, tag, mdl):
    cache = KVCache.init(mdl.config, mdl.mesh, batch=2, length=16)
    tokens = jnp.asarray([[5, 17, 99, 3, 250, 7], [11, 12, 13, 14, 15, 16]], jnp.int32)
    fwd = nnx.jit(lambda m, t, p, c: m.forward_cached(t, p, c))
    logits, layers = fwd(mdl, tokens, None, cache.layers())
    out[f"cached/{tag}/prefill"] = np.asarray(logits)
    nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
    pos = jnp.full((2, 1), 6, jnp.int32)
    logits, _ = fwd(mdl, nxt, pos, layers)
    out[f"cached/{tag}/step"] = np.asarray(logits)


def collect() -> dict:
    out = {}
    for scheme, kw in SCHEMES.items():
        config = dataclasses.replace(TINY, **kw)
        for tp, data in ((1, 1), (4, 2)):
            print(f"train {scheme} tp{tp} data{data}", file=sys.stderr, flush=True)
            train_step(out, f"{scheme}/tp{tp}x{data}", config, tp, data)
    for scheme in ("ladder", "parallel"):
        config = dataclasses.replace(TINY, remat="module", **SCHEMES[scheme])
        train_step(out, f"{scheme}-remat/tp4x2", config, 4, 2)
    train_step(
        out, "ladder-fsdp/tp4x2", dataclasses.replace(TINY, residual="ladder"), 4, 2, fsdp=True
    )
    train_step(out, "ladder/tp8x1", dataclasses.replace(TINY, residual="ladder"), 8, 1)
    print("decode", file=sys.stderr, flush=True)
    for scheme in ("standard", "parallel", "ladder", "hybrid"):
        decode(out, f"{scheme}/tp4", model(4, **SCHEMES[scheme]))
        decode(out, f"{scheme}-consume/tp2", model(2, **SCHEMES[scheme]), consume=True)
        cached_logits(out, f"{scheme}/tp4", model(4, **SCHEMES[scheme]))
        qm = quant.quantize(model(4, **SCHEMES[scheme]))
        decode(out, f"{scheme}-int8/tp4", qm)
        out[f"int8-forward/{scheme}/tp4"] = np.asarray(
            nnx.jit(lambda m, t: m(t))(qm, jnp.asarray([PROMPTS[0]], jnp.int32))
        )
    q8 = quant.quantize(model(8, residual="ladder"))  # replicated kv heads, int8
    out["int8-forward/ladder/tp8"] = np.asarray(
        nnx.jit(lambda m, t: m(t))(q8, jnp.asarray([PROMPTS[0]], jnp.int32))
    )
    decode(out, "ladder/tp8", model(8, residual="ladder"))
    cached_logits(out, "ladder-int8/tp8", q8)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare")
    args = ap.parse_args()
    out = collect()
    np.savez(args.out, **out)
    print(f"wrote {len(out)} arrays to {args.out}", file=sys.stderr)
    if args.compare:
        want = dict(np.load(args.compare))
        missing, extra = sorted(set(want) - set(out)), sorted(set(out) - set(want))
        differ = [
            k
            for k in sorted(set(want) & set(out))
            if want[k].dtype != out[k].dtype or not np.array_equal(want[k], out[k])
        ]
        print(
            f"{len(want)} arrays before, {len(out)} now: {len(missing)} missing, "
            f"{len(extra)} new, {len(differ)} differ",
            file=sys.stderr,
        )
        for k in (missing + extra + differ)[:20]:
            print(f"  {k}", file=sys.stderr)
        return 1 if missing or extra or differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
