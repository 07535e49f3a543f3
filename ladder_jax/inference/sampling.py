"""Sampling: the settings of one request (`Sampling`) and the one sampler every program uses, with
per-row settings and keys: one program serves any mix of greedy and sampled rows. Keys, order,
non-finite logits: docs/inference.md, 'Inside the server'.

    Sampling(temperature=0.8, top_k=200, top_p=0.95, seed=7).check(vocab_size)"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ladder_jax.config import UsageError

NONFINITE = -1  # the token of a row whose logits are not finite


class GenerationError(UsageError):
    """Input generation cannot run on; the message gives the numbers."""


class NonFiniteLogits(GenerationError):
    """The model's logits are NaN or infinite: its weights are broken, no output is given."""


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x) -> bool:
    return is_int(x) or isinstance(x, (float, np.floating))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k / top_p filter before sampling (None: off); `seed`
    makes sampling reproducible (a uint32)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def check(self, vocab_size: int) -> "Sampling":
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not (is_number(t) and math.isfinite(t) and t >= 0):
            raise GenerationError(f"temperature={t!r} must be >= 0 and finite (0 = greedy)")
        if k is not None and not (is_int(k) and 1 <= k <= vocab_size):
            raise GenerationError(
                f"top_k={k!r} must be an integer from 1 to the vocabulary "
                f"size {vocab_size} (None: off)"
            )
        if p is not None and not (is_number(p) and 0 < p <= 1):
            raise GenerationError(f"top_p={p!r} must be in (0, 1] (1 or None: off)")
        if not (is_int(s) and 0 <= s < 2**32):
            raise GenerationError(f"seed={s!r} must be an integer from 0 to 2**32 - 1")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings of a batch, as arrays (host numpy or device)."""

    keys: np.ndarray  # (B, 2) uint32: each row's key data
    temperature: np.ndarray  # (B,) float32
    top_k: np.ndarray  # (B,) int32, 0: off
    top_p: np.ndarray  # (B,) float32, 1: off

    @staticmethod
    def of(samplings, rows=None) -> "RowSampling":
        """The settings of `samplings` (checked `Sampling`s), one row each; row b's key is
        fold_in(key(seed), rows[b]) (default: b)."""
        rows = range(len(samplings)) if rows is None else rows
        return RowSampling(
            keys=np.stack([row_key(s.seed, r) for s, r in zip(samplings, rows)]),
            temperature=np.array([s.temperature for s in samplings], np.float32),
            top_k=np.array([s.top_k or 0 for s in samplings], np.int32),
            top_p=np.array([1.0 if s.top_p is None else s.top_p for s in samplings], np.float32),
        )

    @staticmethod
    def empty(batch: int) -> "RowSampling":
        """Greedy rows with zero keys (the free slots of a batch)."""
        return RowSampling(
            np.zeros((batch, 2), np.uint32),
            np.zeros(batch, np.float32),
            np.zeros(batch, np.int32),
            np.ones(batch, np.float32),
        )


def row_key(seed: int, row: int) -> np.ndarray:
    """The key data (2,) uint32 of row `row` of a batch sampled with `seed`."""
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), row)), np.uint32)


def sample_rows(logits_bv, rows: RowSampling, token_b):
    """Token `token_b` (the index of the new token in its row's output, 0 = the first) of
    every row, from float32 logits (B, V), with each row's own settings and key; `NONFINITE`
    for a row whose logits hold a NaN or +inf."""
    greedy_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)

    def one(logits_v, key_data, n, t, k, p):
        V = logits_v.shape[-1]
        x_v = logits_v / jnp.where(t > 0, t, 1.0)
        sorted_v = jnp.sort(x_v)[::-1]
        kth = jnp.where(k > 0, sorted_v[jnp.clip(k - 1, 0, V - 1)], -jnp.inf)
        x_v = jnp.where(x_v < kth, -jnp.inf, x_v)
        sorted_v = jnp.where((jnp.arange(V) < k) | (k <= 0), sorted_v, -jnp.inf)
        probs_v = jax.nn.softmax(sorted_v)
        # keep the smallest set whose mass reaches top_p: a token stays if the mass before it
        # is still below top_p (the most likely token always stays)
        keep_v = ((jnp.cumsum(probs_v) - probs_v) < p) | (p >= 1)
        cutoff = jnp.min(jnp.where(keep_v, sorted_v, jnp.inf))
        x_v = jnp.where(x_v < cutoff, -jnp.inf, x_v)
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), n)
        return jax.random.categorical(key, x_v).astype(jnp.int32)

    def sampled():
        drawn_b = jax.vmap(one)(
            logits_bv, rows.keys, token_b, rows.temperature, rows.top_k, rows.top_p
        )
        return jnp.where((rows.temperature == 0) | (rows.top_k == 1), greedy_b, drawn_b)

    all_greedy = jnp.all((rows.temperature == 0) | (rows.top_k == 1))
    bad_b = jnp.any(jnp.isnan(logits_bv) | (logits_bv == jnp.inf), axis=-1)
    return jnp.where(bad_b, NONFINITE, jax.lax.cond(all_greedy, lambda: greedy_b, sampled))


@functools.partial(jax.jit, static_argnames="s")
def sample(logits_bv, key, s: Sampling):
    """One token per row of float32 logits (B, V) with the settings `s`, row b drawing with
    fold_in(key, b): `sample_rows` for a batch that shares its settings."""
    B = logits_bv.shape[0]
    keys = jax.vmap(lambda b: jax.random.key_data(jax.random.fold_in(key, b)))(jnp.arange(B))
    rows = RowSampling(
        keys.astype(jnp.uint32),
        jnp.full(B, s.temperature, jnp.float32),
        jnp.full(B, s.top_k or 0, jnp.int32),
        jnp.full(B, 1.0 if s.top_p is None else s.top_p, jnp.float32),
    )
    return sample_rows(logits_bv, rows, jnp.zeros(B, jnp.int32))
