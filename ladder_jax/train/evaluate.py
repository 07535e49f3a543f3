"""Held-out loss of a model on a token stream it never trained on, packed as training packs it,
every record counted (docs/training.md, 'Held-out loss').

    loss = held_out_loss(model, data.load_tokens("held_out_books/", tokenizer), seq_len=128)"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ladder_jax.train import data
from ladder_jax.train.step import cross_entropy


@nnx.jit
def loss_sum(model, tokens_bt, targets_bt, mask_bt):
    """(sum of the masked next-token losses, number of unmasked tokens)."""
    n = mask_bt.astype(jnp.float32).sum()
    return cross_entropy(model(tokens_bt), targets_bt, mask_bt) * n, n


def held_out_loss(
    model, tokens: np.ndarray, *, seq_len: int, batch: int = 16, max_records: int | None = None
) -> float:
    """Mean next-token cross-entropy (nats per token) of `model` over the (seq_len + 1)-token
    records of `tokens` (at most `max_records` of them, evenly spaced)."""
    records, _ = data.split(np.asarray(tokens), seq_len, 0.0)
    index = np.arange(len(records))
    if max_records is not None and max_records < len(records):
        index = np.linspace(0, len(records) - 1, max_records).round().astype(int)
    total = count = 0.0
    for start in range(0, len(index), batch):
        rows = [records[int(i)] for i in index[start : start + batch]]
        mask_bt = np.ones((batch, seq_len), np.int32)
        mask_bt[len(rows) :] = 0
        rows += [rows[0]] * (batch - len(rows))  # padding, masked out
        x_bt = np.stack(rows)
        s, c = loss_sum(model, x_bt[:, :-1], x_bt[:, 1:], mask_bt)
        total += float(s)
        count += float(c)
    return total / count


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan")
