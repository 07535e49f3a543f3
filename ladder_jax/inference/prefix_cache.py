"""Prefix caching on the host: which KV-cache row a new prompt goes to and how much of the
prompt's KV some row already holds. Pure Python, no device work: the engine does the copies and
writes this bookkeeping describes, then reports them (`copied`, `wrote`, `keep`).

A row's KV is only reusable from position 0 (RoPE'd keys depend on their position), so what
is shared is a chain of whole blocks from the start of a row. Chains are interned: the id of
block j is looked up from (id of blocks 0..j-1, block j's tokens), exact (no hash collisions)
and O(block) per block, so a claim costs O(prompt length).

    cache = PrefixCache(slots=4, block=16)
    c = cache.claim(prompt, free=[0, 1, 2, 3])   # Claim(slot, reused, source)
    # engine: copy row c.source -> c.slot for [0, c.reused) when source is set, then
    cache.copied(c.source, c.slot, c.reused)     # (only when source is set)
    cache.wrote(c.slot, c.reused, prompt[c.reused:])
    cache.release(c.slot)                        # KV stays reusable until claimed again

Contract with the engine: a round's copies run before that round's writes. A row whose copy is
pending is not a source (its old content is doomed) and a pending copy's source is not made
another copy's destination, so the order of a round's copies does not matter."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Claim:
    """Where a new prompt goes: `slot` (a free row), `reused` prompt tokens whose KV it reuses
    (a multiple of the block, at most len(prompt) - 1), `source` the row to copy positions
    [0, reused) from (None: `slot` holds them already, or reused == 0)."""

    slot: int
    reused: int
    source: int | None


class PrefixCache:
    """Block-granular prefix bookkeeping over `slots` KV rows; see the module docstring."""

    def __init__(self, slots: int, block: int = 16):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be an int >= 1, got {block!r}")
        self.slots, self.block = slots, block
        self.queried_tokens = 0
        self.hit_tokens = 0
        self._tokens: list[list[int]] = [[] for _ in range(slots)]  # what each row's KV holds
        self._chain: list[list[int]] = [[] for _ in range(slots)]  # chain id of each full block
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent id, block) -> id
        self._holders: dict[int, set[int]] = {}  # chain id -> rows holding it
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # chain id -> its _ids key
        self._next_id = 1  # 0 is the empty chain (the parent of every first block)
        self._claimed: set[int] = set()
        self._released: dict[int, int] = {}  # row -> release stamp (LRU)
        self._clock = 0
        self._pending: dict[int, tuple[int, tuple[int, ...]]] = {}  # dst -> (src, prefix)
        self._pending_src: collections.Counter[int] = collections.Counter()
        self._done_early: dict[int, int] = {}  # dst -> src whose copy `wrote` already applied

    # ---- the engine's calls ---------------------------------------------------------------

    def claim(self, prompt: Sequence[int], free: Sequence[int]) -> Claim:
        """Picks the free row for `prompt` and the longest block-aligned prefix it reuses (at
        most len(prompt) - 1 tokens): a free row holding it already if any, else a copy from a
        row holding it into the free row whose loss costs least (a row holding no block first,
        then the least recently released). The row is then claimed (not free)."""
        rows = dict.fromkeys(self._check_row(r) for r in free)
        candidates = [r for r in rows if r not in self._claimed]
        if not candidates:
            raise ValueError("claim: no free row (every row given is claimed)")
        prompt = list(prompt)
        depth, holders = self._longest(prompt)
        slot, source = None, None
        if depth:
            in_place = [r for r in candidates if r in holders]
            movable = [r for r in candidates if not self._pending_src[r]]
            if in_place:
                slot = min(in_place, key=self._loss)
            elif movable:
                slot, source = min(movable, key=self._loss), min(holders)
            else:  # every free row is a pending copy's source: reuse what one holds in place
                slot = min(candidates, key=lambda r: (-self._match(r, prompt), self._loss(r)))
                depth = self._match(slot, prompt)
        if slot is None:
            slot = min(candidates, key=self._loss)
        reused = depth * self.block
        self._claimed.add(slot)
        self._done_early.pop(slot, None)
        if source is not None:
            self._set(slot, 0, ())  # its old content is about to be replaced
            self._pending[slot] = (source, tuple(prompt[:reused]))
            self._pending_src[source] += 1
        self.queried_tokens += len(prompt)
        self.hit_tokens += reused
        return Claim(slot=slot, reused=reused, source=source)

    def wrote(self, slot: int, start: int, tokens: Sequence[int]) -> None:
        """Row `slot` now holds the KV of `tokens` at positions start..start+len-1: what it held
        from `start` on is dropped, its complete blocks are registered. A write past the end of
        what the row holds leaves a gap: nothing from the gap on is registered."""
        self._finish_pending(self._check_row(slot))
        if start < 0:
            raise ValueError(f"wrote: start must be >= 0, got {start}")
        if start <= len(self._tokens[slot]):
            self._set(slot, start, tokens)

    def keep(self, slot: int, length: int) -> None:
        """Row `slot` holds valid KV below `length` only (drops blocks reaching past it). A row
        whose copy is pending holds nothing until `copied` (its claim dropped what it held)."""
        self._check_row(slot)
        if length < 0:
            raise ValueError(f"keep: length must be >= 0, got {length}")
        self._set(slot, length, ())

    def held(self, slot: int) -> int:
        """How many tokens row `slot` holds from position 0 (whole blocks and the partial one
        after them): writing past them loses nothing."""
        return len(self._tokens[self._check_row(slot)])

    def release(self, slot: int) -> None:
        """Its request ended; its KV stays reusable until the row is claimed again."""
        self._claimed.discard(self._check_row(slot))
        self._clock += 1
        self._released[slot] = self._clock

    def copied(self, src: int, dst: int, length: int) -> None:
        """Row dst now holds row src's first `length` tokens (what dst held is replaced)."""
        self._check_row(src)
        self._check_row(dst)
        if self._done_early.get(dst) == src:  # `wrote` already applied this copy
            del self._done_early[dst]
            return
        pending = self._pending.get(dst)
        if pending is not None and pending[0] == src:
            self._drop_pending(dst)
            self._replace(dst, pending[1][:length])
        else:
            self._replace(dst, self._tokens[src][:length])

    # ---- inside ---------------------------------------------------------------------------

    def _check_row(self, row: int) -> int:
        if not 0 <= row < self.slots:
            raise ValueError(f"row {row} is out of range [0, {self.slots})")
        return row

    def _loss(self, row: int) -> tuple[int, int]:
        """What evicting `row` costs, smaller is cheaper: no block held, then LRU."""
        return (1 if self._chain[row] else 0, self._released.get(row, -1))

    def _longest(self, prompt: list[int]) -> tuple[int, set[int]]:
        """(blocks, rows): the most whole blocks of `prompt` (leaving at least one token) that
        some row holds from position 0, and the rows holding exactly that chain."""
        b, parent, depth, holders = self.block, 0, 0, set()
        for j in range(max(len(prompt) - 1, 0) // b):
            cid = self._ids.get((parent, tuple(prompt[j * b : (j + 1) * b])))
            if cid is None:
                break
            parent, depth, holders = cid, j + 1, self._holders[cid]
        return depth, holders

    def _match(self, row: int, prompt: list[int]) -> int:
        """Whole blocks of `prompt` (leaving one token) that `row` itself holds from 0."""
        b, held, n = self.block, self._tokens[row], 0
        while (n + 1) * b <= min(len(held), len(prompt) - 1) and (
            held[n * b : (n + 1) * b] == prompt[n * b : (n + 1) * b]
        ):
            n += 1
        return n

    def _finish_pending(self, dst: int) -> None:
        """A write to a row whose copy is pending: the copy ran first (copies precede writes)."""
        pending = self._pending.get(dst)
        if pending is not None:
            self._drop_pending(dst)
            self._replace(dst, pending[1])
            self._done_early[dst] = pending[0]

    def _drop_pending(self, dst: int) -> None:
        src, _ = self._pending.pop(dst)
        self._pending_src[src] -= 1
        if not self._pending_src[src]:
            del self._pending_src[src]

    def _replace(self, row: int, tokens: Sequence[int]) -> None:
        """Row `row` holds `tokens` from 0: the blocks it shares with what it held stay."""
        b, held, same = self.block, self._tokens[row], 0
        while (same + 1) * b <= min(len(held), len(tokens)) and (
            held[same * b : (same + 1) * b] == list(tokens[same * b : (same + 1) * b])
        ):
            same += 1
        self._set(row, same * b, tokens[same * b :])

    def _set(self, row: int, start: int, tokens: Sequence[int]) -> None:
        """Row `row` holds what it held below `start` (<= its length), then `tokens`:
        unregister its blocks reaching past `start`, register the new whole blocks."""
        b, held, chain = self.block, self._tokens[row], self._chain[row]
        keep = min(start // b, len(chain))
        for cid in chain[keep:]:
            rows = self._holders[cid]
            rows.discard(row)
            if not rows:  # no row holds it: forget it (ids are never reused)
                del self._holders[cid]
                del self._ids[self._key_of.pop(cid)]
        del chain[keep:]
        del held[start:]
        held.extend(int(t) for t in tokens)
        parent = chain[-1] if chain else 0
        for j in range(keep, len(held) // b):
            key = (parent, tuple(held[j * b : (j + 1) * b]))
            cid = self._ids.get(key)
            if cid is None:
                cid, self._next_id = self._next_id, self._next_id + 1
                self._ids[key], self._key_of[cid], self._holders[cid] = cid, key, set()
            self._holders[cid].add(row)
            chain.append(cid)
            parent = cid
