"""PrefixCache against a simulated engine: every row's KV is a token list the test keeps itself;
each claim is checked against a brute-force scan of those lists (longest block-aligned common
prefix, the same row-choice policy), and the KV a claim says it reuses must be the prompt's
after the round's copies, whatever order the copies and the reports come in."""

import random

import pytest

from ladder_jax.inference.prefix_cache import Claim, PrefixCache


def common_blocks(held, prompt, block):
    """Whole blocks of `prompt` (leaving at least one token) that `held` starts with."""
    n = 0
    while (n + 1) * block <= min(len(held), len(prompt) - 1) and (
        held[n * block : (n + 1) * block] == prompt[n * block : (n + 1) * block]
    ):
        n += 1
    return n


class Reference:
    """The claim policy by brute force over the simulated rows' token lists."""

    def __init__(self, slots, block):
        self.block, self.kv = block, [[] for _ in range(slots)]
        self.claimed, self.stamp, self.clock = set(), {}, 0
        self.copy_dst, self.copy_src = set(), set()  # this round's pending copies

    def loss(self, r):
        return (1 if len(self.kv[r]) >= self.block else 0, self.stamp.get(r, -1))

    def claim(self, prompt, free):
        cands = [r for r in dict.fromkeys(free) if r not in self.claimed]
        if not cands:
            return None
        valid = [r for r in range(len(self.kv)) if r not in self.copy_dst]
        depth = max([common_blocks(self.kv[r], prompt, self.block) for r in valid] + [0])
        holders = [r for r in valid if common_blocks(self.kv[r], prompt, self.block) == depth]
        slot, source = min(cands, key=self.loss), None
        if depth:
            in_place = [r for r in cands if r in holders]
            movable = [r for r in cands if r not in self.copy_src]
            if in_place:
                slot = min(in_place, key=self.loss)
            elif movable:
                slot, source = min(movable, key=self.loss), min(holders)
            else:
                slot = min(
                    cands,
                    key=lambda r: (-common_blocks(self.kv[r], prompt, self.block), self.loss(r)),
                )
                depth = common_blocks(self.kv[slot], prompt, self.block)
        self.claimed.add(slot)
        if source is not None:
            self.copy_dst.add(slot)
            self.copy_src.add(source)
        return Claim(slot, depth * self.block, source)

    def release(self, r):
        self.claimed.discard(r)
        self.clock += 1
        self.stamp[r] = self.clock


def simulate(seed, slots=5, block=2, vocab=3, rounds=200):
    """Random rounds of claims, copies (shuffled), chunked prompt writes, decode writes,
    rollbacks and releases; returns how many claims reused something."""
    rng = random.Random(seed)
    cache, ref = PrefixCache(slots, block), Reference(slots, block)
    stems = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 14))] for _ in range(4)]
    todo, decode_left = {}, {}  # row -> prompt tokens still to write; decode tokens to go
    hits = queried = reused_total = 0
    for _ in range(rounds):
        free = [r for r in range(slots) if r not in ref.claimed]
        claims = []
        for _ in range(rng.randrange(0, 6)):
            prompt = rng.choice(stems)[: rng.randrange(0, 15)]
            prompt = prompt + [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
            want = ref.claim(prompt, free)
            if want is None:
                with pytest.raises(ValueError, match="no free row"):
                    cache.claim(prompt, free)
                continue
            got = cache.claim(prompt, free)
            assert got == want, (prompt, [list(k) for k in ref.kv])
            if rng.random() < 0.5:  # as the engine does: the row's KV past the reuse is doomed
                keep = got.reused if got.source is None else 0
                cache.keep(got.slot, keep)
                ref.kv[got.slot] = ref.kv[got.slot][:keep]
            assert got.reused % block == 0 and got.reused <= len(prompt) - 1
            claims.append((got, prompt))
            queried, reused_total = queried + len(prompt), reused_total + got.reused
            hits += got.reused > 0
        # the engine's copies, in any order, before the writes
        copies = [c for c, _ in claims if c.source is not None]
        for c in rng.sample(copies, len(copies)):
            ref.kv[c.slot] = ref.kv[c.source][: c.reused]
        for c, prompt in claims:
            assert ref.kv[c.slot][: c.reused] == prompt[: c.reused]
            todo[c.slot], decode_left[c.slot] = prompt[c.reused :], rng.randrange(0, 6)
            ref.kv[c.slot] = ref.kv[c.slot][: c.reused]  # what the row holds from here on
        ref.copy_dst, ref.copy_src = set(), set()
        # reports: copied() either before or after the writes
        early = [c for c in copies if rng.random() < 0.5]
        for c in early:
            cache.copied(c.source, c.slot, c.reused)
        for row in rng.sample(sorted(todo), len(todo)):
            start = len(ref.kv[row])
            if todo[row]:
                n = rng.randrange(1, 6)
                chunk, todo[row] = todo[row][:n], todo[row][n:]
            elif decode_left[row]:
                chunk = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
                decode_left[row] -= 1
            else:
                del todo[row], decode_left[row]
                cache.release(row)
                ref.release(row)
                continue
            cache.wrote(row, start, chunk)
            ref.kv[row] = ref.kv[row][:start] + chunk
            if not todo[row] and rng.random() < 0.3:  # a rejected speculation rolls back
                keep = max(len(ref.kv[row]) - rng.randrange(0, 3), 0)
                cache.keep(row, keep)
                ref.kv[row] = ref.kv[row][:keep]
        for c in copies:
            if c not in early:
                cache.copied(c.source, c.slot, c.reused)
    assert (cache.queried_tokens, cache.hit_tokens) == (queried, reused_total)
    return hits


@pytest.mark.parametrize("seed", range(12))
def test_random_rounds_match_brute_force(seed):
    block = [1, 2, 2, 3][seed % 4]
    hits = simulate(seed, slots=3 + seed % 4, block=block, vocab=2 + seed % 2)
    assert hits > 5  # the small vocab makes prefixes collide: the test exercises reuse


def test_no_reuse_of_the_last_token():
    """At least one prompt token is computed: a prompt equal to a held row reuses one block
    less than it holds, and a prompt of exactly one block reuses nothing."""
    cache = PrefixCache(2, block=4)
    cache.wrote(cache.claim([1] * 8, [0, 1]).slot, 0, [1] * 8)
    c = cache.claim([1] * 8, [1])
    assert c == Claim(slot=1, reused=4, source=0)
    cache.release(0)
    assert cache.claim([1] * 4, [0]) == Claim(slot=0, reused=0, source=None)
    assert PrefixCache(1, block=4).claim([], [0]) == Claim(0, 0, None)


def test_prefers_the_free_row_holding_the_prefix():
    cache = PrefixCache(3, block=2)
    for row, tokens in [(0, [5, 6, 7, 8]), (1, [5, 6, 9, 9]), (2, [5, 6, 7, 8, 1])]:
        cache.wrote(cache.claim(tokens, [row]).slot, 0, tokens)
    for row in (0, 1, 2):
        cache.release(row)
    assert cache.claim([5, 6, 7, 8, 3], [1, 2]) == Claim(slot=2, reused=4, source=None)
    # row 0 holds it too but is busy now: the copy goes to the free row 1
    cache.wrote(2, 4, [3])
    assert cache.claim([5, 6, 7, 8, 4, 4], [1]) == Claim(slot=1, reused=4, source=0)


def test_evicts_the_least_recently_released_row_and_unused_rows_first():
    cache = PrefixCache(4, block=2)
    for row in (0, 1, 2):
        cache.wrote(cache.claim([row] * 4, [row]).slot, 0, [row] * 4)
    for row in (1, 0, 2):
        cache.release(row)
    assert cache.claim([9, 9, 9], [0, 1, 2, 3]).slot == 3  # never used
    assert cache.claim([9, 9, 9], [0, 1, 2, 3]).slot == 1  # released first
    assert cache.claim([9, 9, 9], [0, 1, 2, 3]).slot == 0
    with pytest.raises(ValueError, match="no free row"):
        cache.claim([9], [0, 1, 3])


def test_keep_drops_partial_blocks():
    cache = PrefixCache(2, block=4)
    cache.wrote(cache.claim([1, 2, 3, 4, 5, 6, 7, 8, 9], [0]).slot, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    cache.keep(0, 7)  # the second block reaches past 7: gone
    cache.release(0)
    assert cache.claim([1, 2, 3, 4, 5, 6, 7, 8, 9], [1]) == Claim(1, 4, 0)
    cache.keep(1, 0)
    cache.wrote(0, 7, [8, 9, 9, 9])  # rewrite from 7: blocks 0..1 hold [1..8] again
    cache.release(1)
    assert cache.claim([1, 2, 3, 4, 5, 6, 7, 8, 0], [1]) == Claim(1, 8, 0)


def test_copied_without_a_claim_and_a_source_claimed_in_the_same_round():
    cache = PrefixCache(3, block=2)
    cache.wrote(0, 0, [1, 2, 3, 4, 5])
    cache.copied(0, 1, 4)  # the engine copied on its own: row 1 holds [1, 2, 3, 4]
    cache.keep(0, 0)
    a = cache.claim([1, 2, 3, 4, 7], [1, 2])
    assert a == Claim(1, 4, None)
    b = cache.claim([1, 2, 3, 9], [2])  # row 1 is claimed (in place) and still a source
    assert b == Claim(2, 2, 1)


def test_bad_arguments():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="block"):
            PrefixCache(2, block=bad)
    with pytest.raises(ValueError, match="slots"):
        PrefixCache(0)
    with pytest.raises(ValueError, match="out of range"):
        PrefixCache(2).claim([1, 2], [2])


@pytest.mark.parametrize("when", [0, 1, 2])
def test_copy_from_a_row_rewritten_in_the_same_round(when):
    """Row 0 is claimed in place (reusing 2) and, in the same round, is the source of a copy of
    6 tokens; its write lands after the copy ran. Whenever `copied` is reported (before, between
    or after the two writes), row 1 holds the 6 copied tokens."""
    cache = PrefixCache(3, block=2)
    cache.wrote(0, 0, [1, 2, 3, 4, 5, 6, 7])
    assert cache.claim([1, 2, 9], [0, 1, 2]) == Claim(0, 2, None)
    assert cache.claim([1, 2, 3, 4, 5, 6, 8], [1, 2]) == Claim(1, 6, 0)
    reports = [lambda: cache.wrote(0, 2, [9]), lambda: cache.wrote(1, 6, [8])]
    reports.insert(when, lambda: cache.copied(0, 1, 6))
    for report in reports:
        report()
    assert cache.claim([1, 2, 3, 4, 5, 6, 8, 8], [2]) == Claim(2, 6, 1)


def test_a_pending_copy_source_is_not_overwritten_by_another_copy():
    """Row 0 is the source of a copy not yet run: a second claim that can only have row 0
    reuses nothing rather than copy into it (the copies' order would then matter)."""
    cache = PrefixCache(3, block=2)
    cache.wrote(0, 0, [1, 2, 3, 4])
    cache.wrote(2, 0, [7, 7, 7, 7])
    cache.claim([5], [2])  # row 2 is busy
    assert cache.claim([1, 2, 3, 4, 5], [1]) == Claim(1, 4, 0)
    assert cache.claim([7, 7, 7], [0]) == Claim(0, 0, None)


def test_a_copied_row_is_a_source_once_written():
    """The engine's order: claim (a copy), keep(dst, 0) at once, the copy runs (`copied`), the
    rest of the prompt is written; the row then holds the whole prompt for later claims."""
    cache = PrefixCache(3, block=2)
    cache.wrote(0, 0, [1, 2, 3, 4, 5])
    cache.claim([9], [0])  # row 0 is busy
    c = cache.claim([1, 2, 3, 4, 6, 7, 8], [1, 2])
    assert c == Claim(1, 4, 0)
    cache.keep(1, 0)
    cache.copied(0, 1, 4)
    cache.wrote(1, 4, [6, 7, 8])
    assert cache.claim([1, 2, 3, 4, 6, 7, 8, 9], [2]) == Claim(2, 6, 1)
