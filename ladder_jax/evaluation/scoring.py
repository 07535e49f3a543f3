"""Loglikelihoods of (context, continuation) token pairs, each context computed once into a KV
cache; a pair's score is the same alone or in any batch (docs/evaluation.md, 'How pairs are
scored').

    scores = Scorer(model).score([encode_pair(tokenizer, context, continuation)], batch_size=32)"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax.config import ConfigError
from ladder_jax.inference.cache import KVCache
from ladder_jax.inference.generation import to_device, to_host
from ladder_jax.model import quant, sharding
from ladder_jax.model.layout import DATA


@dataclasses.dataclass(frozen=True)
class Score:
    logprob: float  # summed over the continuation's tokens
    tokens: int
    greedy: bool  # every continuation token was the model's argmax


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of one request (docs/evaluation.md, 'How pairs are
    scored')."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if not context:
        prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        if prefix is None:
            raise ConfigError(
                "an empty context needs a BOS or EOS token to start from, and "
                "this tokenizer has neither"
            )
        return [prefix], list(tokenizer.encode(continuation, bos=False))
    bos = getattr(tokenizer, "add_bos", True)
    ctx = list(tokenizer.encode(context, bos=bos))
    cont = list(tokenizer.encode(context + continuation, bos=bos))[len(ctx) :]
    if not cont:
        cont = list(tokenizer.encode(continuation, bos=False))
    if not cont:
        raise ConfigError(f"the continuation {continuation!r} encodes to no tokens")
    if not ctx:
        raise ConfigError(
            f"the context {context[:40]!r} encodes to no tokens and this tokenizer adds no BOS"
        )
    return ctx, cont


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _programs(graphdef, treedef, mesh):
    """The jitted (prefill, score) of a model graph on `mesh` (shared by equal graphs)."""

    def merged(weights):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))

    def prefill(weights, cache, tokens_bt):
        # positions None: from slot 0, causal flash attention; the logits are dropped, so XLA
        # drops the head's matmul
        _, layers = merged(weights).forward_cached(tokens_bt, None, cache.layers())
        return KVCache.from_layers(layers)

    def gather(cache, rows_n):
        return jax.tree.map(lambda c: jnp.take(c, rows_n, axis=0), cache)

    def score(weights, rows, tokens_nt, positions_nt, targets_nt):
        # the rows' caches come gathered (`gather`), so the model's program does not depend
        # on how many contexts the prefill held
        logits_ntv, _ = merged(weights).forward_cached(tokens_nt, positions_nt, rows.layers())
        logp_ntv = jax.nn.log_softmax(logits_ntv.astype(jnp.float32), axis=-1)
        lp_nt = jnp.take_along_axis(logp_ntv, targets_nt[..., None], axis=-1)[..., 0]
        return lp_nt, jnp.argmax(logits_ntv, axis=-1) == targets_nt

    replicated, cached = NamedSharding(mesh, P()), NamedSharding(mesh, sharding.CACHE_BKSH)
    return (
        sharding.jit(prefill, mesh=mesh, donate_argnums=(1,), out_shardings=cached),
        sharding.jit(gather, mesh=mesh, out_shardings=cached),
        sharding.jit(score, mesh=mesh, out_shardings=(replicated, replicated)),
    )


class Scorer:
    """One model's jitted context prefill and continuation scoring (docs/evaluation.md). A
    quantized model on a CPU mesh is scored through its float copy, as decoding does."""

    def __init__(self, model):
        self.config, self.mesh = model.config, model.mesh
        if self.mesh.devices.flat[0].platform == "cpu":
            model = quant.dequantize(model)
        graphdef, state = nnx.split(model)
        self.weights, treedef = jax.tree.flatten(state)
        self._prefill, self._gather, self._score = _programs(graphdef, treedef, self.mesh)

    def score(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        *,
        batch_size: int = 32,
        progress: Callable[[int], None] | None = None,
    ) -> list[Score]:
        """One `Score` per (context ids, continuation ids) pair, in order; `progress(n)` is
        called with the number of pairs each continuation pass finished."""
        if batch_size < 1:
            raise ConfigError(f"batch size {batch_size}: give at least 1")
        pairs = [self._fit(ctx, cont) for ctx, cont in pairs]
        by_ctx: dict[tuple, list[int]] = {}
        for i, (ctx, _) in enumerate(pairs):
            by_ctx.setdefault(ctx, []).append(i)
        longest = {c: max(len(pairs[i][1]) for i in ids) for c, ids in by_ctx.items()}
        order = sorted(by_ctx, key=lambda c: (-len(c), -longest[c]))
        out: list[Score | None] = [None] * len(pairs)
        batch: list[tuple] = []
        for n, ctx in enumerate(order):
            batch.append(ctx)
            if (
                n + 1 == len(order)
                or len(batch) == batch_size
                or sum(len(by_ctx[c]) for c in batch) >= batch_size
            ):
                self._run(batch, by_ctx, pairs, out, batch_size, progress)
                batch = []
        return out

    def _fit(self, ctx, cont) -> tuple[tuple, tuple]:
        limit = self.config.max_seq_len
        if len(cont) >= limit:
            raise ConfigError(
                f"a continuation of {len(cont)} tokens does not fit the model's "
                f"max_seq_len {limit} with any context"
            )
        keep = limit - len(cont) + 1  # the scored sequence is ctx + cont[:-1]
        return tuple(ctx[-keep:]), tuple(cont)

    def _run(self, contexts, by_ctx, pairs, out, batch_size, progress) -> None:
        data = self.mesh.shape[DATA]
        B = -(-_bucket(len(contexts), 1) // data) * data
        T = _bucket(max(len(c) - 1 for c in contexts), 16)
        tokens_bt = np.zeros((B, T), np.int32)
        for b, c in enumerate(contexts):
            tokens_bt[b, : len(c) - 1] = c[:-1]
        # longest continuations first: each pass of rows is padded to its own bucket
        rows = sorted(
            ((b, i) for b, c in enumerate(contexts) for i in by_ctx[c]),
            key=lambda r: -len(pairs[r[1]][1]),
        )
        S = _bucket(
            max(T, max(len(c) for c in contexts) - 1 + _bucket(len(pairs[rows[0][1]][1]), 8)), 64
        )
        cache = KVCache.init(self.config, self.mesh, B, S)
        cache = self._prefill(self.weights, cache, to_device(tokens_bt, self.mesh))
        N = -(-min(batch_size, _bucket(len(rows), 1)) // data) * data
        for start in range(0, len(rows), N):
            chunk = rows[start : start + N]
            C = _bucket(len(pairs[chunk[0][1]][1]), 8)
            rows_n = np.zeros(N, np.int32)
            tokens_nt, targets_nt = np.zeros((N, C), np.int32), np.zeros((N, C), np.int32)
            positions_nt = np.broadcast_to(np.arange(C, dtype=np.int32), (N, C)).copy()
            for n, (b, i) in enumerate(chunk):
                ctx, cont = pairs[i]
                rows_n[n] = b
                tokens_nt[n, : len(cont)] = (ctx[-1],) + cont[:-1]
                targets_nt[n, : len(cont)] = cont
                positions_nt[n] += len(ctx) - 1
            rows_cache = self._gather(cache, to_device(rows_n, self.mesh))
            lp_nt, greedy_nt = self._score(
                self.weights,
                rows_cache,
                *(to_device(a, self.mesh) for a in (tokens_nt, positions_nt, targets_nt)),
            )
            lp_nt, greedy_nt = to_host(lp_nt), to_host(greedy_nt)
            for n, (_, i) in enumerate(chunk):
                k = len(pairs[i][1])
                out[i] = Score(
                    float(lp_nt[n, :k].astype(np.float64).sum()), k, bool(greedy_nt[n, :k].all())
                )
            if progress is not None:
                progress(len(chunk))
