"""The KV cache: a typed pytree, one key and one value array per layer. Its layout, and why to
size it with `cache_length`: docs/architecture.md, 'The KV cache layout'.

    cache = KVCache.init(config, mesh, batch=4, length=256)      # zeros, in their sharding
    shapes = KVCache.abstract(config, mesh, batch=4, length=256)  # ShapeDtypeStructs only"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ladder_jax.config import ModelConfig
from ladder_jax.model import layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple  # L arrays (B, K', H, S)
    v: tuple  # L arrays (B, K', S, H)

    @staticmethod
    def abstract(config: ModelConfig, mesh, batch: int, length: int) -> "KVCache":
        """The cache as `jax.ShapeDtypeStruct`s carrying their shardings (nothing allocated)."""
        heads = layout.cache_kv_heads(config, layout.tp_size(mesh))
        H, dtype = config.head_dim, jnp.dtype(config.dtype)
        spec = NamedSharding(mesh, layout.CACHE_BKSH)
        k = jax.ShapeDtypeStruct((batch, heads, H, length), dtype, sharding=spec)
        v = jax.ShapeDtypeStruct((batch, heads, length, H), dtype, sharding=spec)
        return KVCache((k,) * config.n_layers, (v,) * config.n_layers)

    @staticmethod
    def init(config: ModelConfig, mesh, batch: int, length: int) -> "KVCache":
        """A zeroed cache for `batch` rows of `length` slots, created in its sharding."""
        shapes = KVCache.abstract(config, mesh, batch, length)
        k, v = (_zeros(x.shape, x.dtype, x.sharding) for x in (shapes.k[0], shapes.v[0]))
        return KVCache(
            tuple(k() for _ in range(config.n_layers)), tuple(v() for _ in range(config.n_layers))
        )

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def length(self) -> int:
        return self.v[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (global) cache, replicated kv heads counted once per copy."""
        return sum(x.size * jnp.dtype(x.dtype).itemsize for x in (*self.k, *self.v))

    def layers(self) -> list[tuple]:
        """The (k, v) of every layer: what `Transformer.forward_cached` takes and returns."""
        return list(zip(self.k, self.v))

    @staticmethod
    def from_layers(layers) -> "KVCache":
        return KVCache(tuple(k for k, _ in layers), tuple(v for _, v in layers))


@functools.lru_cache(maxsize=64)
def _zeros(shape, dtype, sharding):
    """A jitted maker of zeros, one per shape and sharding: compiled once, not per cache."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cache_length(config: ModelConfig, longest_prompt: int, new_tokens: int) -> int:
    """Cache slots for a batch: room for the longest prompt and the new tokens, rounded so
    that nearby requests reuse compiled programs."""
    return min(round_up(longest_prompt + new_tokens, 64), config.max_seq_len)
