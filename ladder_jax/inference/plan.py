"""One round of the serving engine as data: built on process 0, broadcast to every process as one
int32 vector (float settings as their bits), run by all. `Plan.to_array` / `Plan.from_array` are
the one place its layout is written.

    arr = plan.to_array(shape); Plan.from_array(arr, shape) == plan"""

from __future__ import annotations

import dataclasses

import numpy as np

from ladder_jax.inference.sampling import RowSampling

# what a round's decode part runs
IDLE, DECODE, SCORED, VERIFY = 0, 1, 2, 3


def _bits(x) -> np.ndarray:
    """float32 values as the int32 words that carry them in a plan (bit for bit)."""
    return np.ascontiguousarray(x, np.float32).view(np.int32)


def _floats(x) -> np.ndarray:
    return np.ascontiguousarray(x, np.int32).view(np.float32)


def _settings(r: RowSampling) -> np.ndarray:
    """(rows, 5) words: key (2), temperature, top_k, top_p."""
    return np.stack(
        [
            r.keys[:, 0].view(np.int32),
            r.keys[:, 1].view(np.int32),
            _bits(r.temperature),
            r.top_k.astype(np.int32),
            _bits(r.top_p),
        ],
        1,
    )


def _sampling(words: np.ndarray) -> RowSampling:
    """The inverse of `_settings`."""
    return RowSampling(
        np.ascontiguousarray(words[:, 0:2]).view(np.uint32),
        _floats(words[:, 2]),
        words[:, 3].copy(),
        _floats(words[:, 4]),
    )


@dataclasses.dataclass(frozen=True)
class PlanShape:
    """The fixed size of every plan of one engine: `slots` rows, at most `admit` chunks a round,
    `pool` prompt tokens in all, `drafts` drafted tokens per row, a block table of `pages`
    entries per row."""

    slots: int
    admit: int
    pool: int
    drafts: int
    pages: int

    HEADER = 3  # run, decode, chunks
    SLOT = 10  # token, position, key (2), temperature, top_k, top_p, count, busy, drafted
    CHUNK = 11  # slot, start, length, key (2), temperature, top_k, top_p, final, scored, index

    @property
    def size(self) -> int:
        B = self.slots
        return (
            self.HEADER
            + B * (self.SLOT + self.drafts + self.pages)
            + self.admit * self.CHUNK
            + self.pool
        )


@dataclasses.dataclass
class Chunk:
    """A prompt's next tokens into cache row `slot` at positions `start`...; `final`: the
    prompt's last chunk (its next token is drawn, with the row's settings `rows`, as token
    `index` of the request's output: 0, or the tokens a preempted request had produced);
    `scored`: a whole prompt from position 0, scored (logprobs, echo)."""

    slot: int
    start: int
    tokens: np.ndarray  # (n,) int32
    rows: RowSampling  # (1,)
    final: bool
    scored: bool = False
    index: int = 0


@dataclasses.dataclass
class Plan:
    """One round over the block table `table_bm` (the pages each row owns now): the decode part
    (`decode`: IDLE none, DECODE the plain steps, SCORED the scored ones (some request wants
    logprobs), VERIFY one speculative step of each row's newest token and its `drafted_b`
    drafts `drafts_bk`) over the rows busy decoding (`busy_b`; per row its newest token,
    position, settings and tokens so far), then the `chunks`."""

    run: bool  # False: stop the loop
    decode: int
    tokens_b: np.ndarray  # (B,) int32
    positions_b: np.ndarray  # (B,) int32
    rows: RowSampling  # (B,)
    count_b: np.ndarray  # (B,) int32
    busy_b: np.ndarray  # (B,) bool
    drafts_bk: np.ndarray  # (B, drafts) int32
    drafted_b: np.ndarray  # (B,) int32
    table_bm: np.ndarray  # (B, pages) int32
    chunks: list[Chunk] = dataclasses.field(default_factory=list)

    def to_array(self, shape: PlanShape) -> np.ndarray:
        B, K = shape.slots, shape.drafts
        if len(self.chunks) > shape.admit:
            raise ValueError(f"a plan holds at most {shape.admit} chunks")
        out = np.zeros(shape.size, np.int32)
        out[:3] = [self.run, self.decode, len(self.chunks)]
        o = shape.HEADER
        block = np.concatenate(
            [
                np.stack([self.tokens_b, self.positions_b], 1),
                _settings(self.rows),
                np.stack([self.count_b, self.busy_b.astype(np.int32), self.drafted_b], 1),
            ],
            1,
        )
        out[o : o + shape.SLOT * B] = block.reshape(-1)
        o += shape.SLOT * B
        out[o : o + B * K] = np.asarray(self.drafts_bk, np.int32).reshape(-1)
        o += B * K
        out[o : o + B * shape.pages] = np.asarray(self.table_bm, np.int32).reshape(-1)
        o += B * shape.pages
        pool = o + shape.CHUNK * shape.admit
        for j, c in enumerate(self.chunks):
            n = len(c.tokens)
            words = [c.slot, c.start, n, *_settings(c.rows)[0], c.final, c.scored, c.index]
            out[o + shape.CHUNK * j : o + shape.CHUNK * (j + 1)] = words
            if pool + n > shape.size:
                raise ValueError(f"a plan's chunks hold at most {shape.pool} tokens in all")
            out[pool : pool + n] = c.tokens
            pool += n
        return out

    @classmethod
    def from_array(cls, arr: np.ndarray, shape: PlanShape) -> "Plan":
        B, K = shape.slots, shape.drafts
        o = shape.HEADER
        block = arr[o : o + shape.SLOT * B].reshape(B, shape.SLOT)
        o += shape.SLOT * B
        drafts_bk = arr[o : o + B * K].reshape(B, K).copy()
        o += B * K
        table_bm = arr[o : o + B * shape.pages].reshape(B, shape.pages).copy()
        o += B * shape.pages
        pool = o + shape.CHUNK * shape.admit
        chunks = []
        for j in range(int(arr[2])):
            h = arr[o + shape.CHUNK * j : o + shape.CHUNK * (j + 1)]
            n = int(h[2])
            tokens = arr[pool : pool + n].copy()
            final, scored = map(bool, h[8:10])
            chunks.append(
                Chunk(
                    int(h[0]), int(h[1]), tokens, _sampling(h[None, 3:8]), final, scored, int(h[10])
                )
            )
            pool += n
        return cls(
            bool(arr[0]),
            int(arr[1]),
            block[:, 0].copy(),
            block[:, 1].copy(),
            _sampling(block[:, 2:7]),
            block[:, 7].copy(),
            block[:, 8].astype(bool),
            drafts_bk,
            block[:, 9].copy(),
            table_bm,
            chunks,
        )
