"""Continuous batching over the jitted decode step: a fixed number of slots, each owning one row
of one KV cache, filled and emptied between decode steps.

    engine = Engine(model, slots=16, max_queue=64); engine.start(); engine.submit(request)

Each round is one *plan*, built on process 0 from host state: `steps_per_plan` decode steps
over all slots, then up to `prefills_per_step` waiting requests prefilled into free rows, one
program per prompt-length bucket. Every token reaches the host each round (at most one program
queued); finished requests free their slot at once. Invariant: a slot's tokens depend only on
its own prompt, settings and key, so greedy it equals `generate` of that prompt alone. Many
processes: process 0 broadcasts each plan, the others `follow()`. Meshes with data > 1 are
refused; callbacks run on the scheduling thread and must not block.
Requests with `logprobs` run the scored variants of both programs (`Decoder.*_scored`,
compiled on first use); the others keep the plain programs.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from ladder_jax.inference.cache import KVCache
from ladder_jax.inference.generation import (
    TOP_LOGPROBS,
    Decoder,
    rows_to_device,
    to_device,
    to_host,
)
from ladder_jax.inference.sampling import NONFINITE, GenerationError, Rows, Sampling
from ladder_jax.model import sharding
from ladder_jax.model.transformer import Transformer

_HEAD = 8  # a prefill block's header: slot, length, key (2), temperature, top_k, top_p, scored


class EngineFull(GenerationError):
    """The waiting queue is full (or the engine is draining): try again later."""


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    eos_id: int | None = None
    on_token: Callable[[int], None] = lambda token: None
    on_finish: Callable[[str], None] = lambda reason: None  # length stop cancelled error
    # nonfinite (the model's logits were NaN or infinite)
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    rows: Rows | None = None  # its sampling settings (set by submit)
    # scoring: logprobs=N (0..TOP_LOGPROBS) records, before each on_token, (log p, the top N
    # ids, their log p) in `scores`; with echo too, `prompt_scores` holds the same for the
    # prompt's tokens 1.. (set before the first token). max_tokens=0: prefill only, no token
    logprobs: int | None = None
    echo: bool = False
    scores: list = dataclasses.field(default_factory=list)
    prompt_scores: list | None = None


def prefill_group(n: int) -> int:
    """The rows of a prefill of n admitted prompts: the next power of two >= n."""
    return 1 << (n - 1).bit_length()


def prompt_bucket(n: int, length: int) -> int:
    """The padded prompt length of a prefill: the next power of two >= n (>= 16, <= length)."""
    return min(max(16, 1 << (n - 1).bit_length()), length)


class Engine:
    def __init__(self, model: Transformer, *, slots: int = 16, max_len: int | None = None,
                 max_queue: int = 64, prefills_per_step: int = 4, steps_per_plan: int = 2,
                 heartbeat_s: float = 1.0, consume: bool = False):
        mesh = model.mesh
        if sharding.data_size(mesh) != 1:
            raise GenerationError(f"the server batches over slots of one cache: use a mesh "
                                  f"with data=1 (got data={sharding.data_size(mesh)})")
        c = model.config
        self.model, self.mesh, self.config = model, mesh, c
        self.slots, self.max_queue = slots, max_queue
        self.length = min(max_len or c.max_seq_len, c.max_seq_len)
        self.prefills_per_step, self.heartbeat_s = prefills_per_step, heartbeat_s
        if steps_per_plan < 1:
            raise GenerationError(f"steps_per_plan must be >= 1, got {steps_per_plan}")
        self.steps_per_plan = steps_per_plan
        self.admit = prefills_per_step * steps_per_plan  # prefills per plan: same rate per step
        self.decoder = Decoder(model, consume=consume)  # consume: the engine owns model
        self.cache = KVCache.init(c, mesh, slots, self.length)
        self.lead = jax.process_index() == 0
        self.many = jax.process_count() > 1
        # host state of the slots (process 0)
        self.owner: list[Request | None] = [None] * slots
        self.last = np.zeros(slots, np.int32)  # each slot's newest token
        self.length_b = np.zeros(slots, np.int32)  # prompt lengths
        self.count_b = np.zeros(slots, np.int32)  # tokens produced so far
        self.settings = Rows.empty(slots)
        self.queue: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.admitting, self.stopping = True, False
        self.thread: threading.Thread | None = None
        self.steps = 0  # decode steps run
        self.error: str | None = None  # why the loop died, if it did
        # plan layout: header, decode block (per slot), prefill blocks
        self._plan_size = 3 + 9 * slots + self.admit * (_HEAD + self.length)

    # -- process 0: requests in ---------------------------------------------------------------

    def check(self, req: Request) -> None:
        """Refuses what the cache cannot hold (before any device work)."""
        n, c = len(req.prompt), self.config
        if n == 0:
            raise GenerationError("the prompt is empty: give at least one token")
        bad = [t for t in req.prompt if not 0 <= t < c.vocab_size]
        if bad:
            raise GenerationError(f"the prompt has token ids outside [0, {c.vocab_size}): "
                                  f"{bad[:5]}")
        if req.logprobs is not None and not (0 <= req.logprobs <= TOP_LOGPROBS):
            raise GenerationError(f"logprobs={req.logprobs} must be from 0 to {TOP_LOGPROBS}")
        if req.max_tokens < 0 or (req.max_tokens == 0 and not req.echo):
            raise GenerationError(f"max_tokens={req.max_tokens} must be >= 1 (0: with echo, "
                                  f"to score the prompt only)")
        if n + req.max_tokens > self.length:
            raise GenerationError(
                f"the prompt has {n} tokens; with max_tokens={req.max_tokens} that is "
                f"{n + req.max_tokens} positions, but a slot holds {self.length}: shorten the "
                f"prompt or lower max_tokens")

    def submit(self, req: Request) -> None:
        self.check(req)
        req.sampling.check(self.config.vocab_size)
        req.rows = Rows.of([req.sampling], rows=[0])
        with self.lock:
            if not self.admitting:
                raise EngineFull("the server is shutting down")
            if len(self.queue) >= self.max_queue:
                raise EngineFull(f"all {self.slots} slots are busy and {len(self.queue)} "
                                 f"requests wait: try again later")
            self.queue.append(req)
            self.lock.notify()

    def cancel(self, req: Request) -> None:
        """Frees the request's slot before the next step (or drops it from the queue)."""
        req.cancelled = True
        with self.lock:
            self.lock.notify()

    @property
    def busy(self) -> int:
        return sum(o is not None for o in self.owner)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    # -- the loop -----------------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._lead_loop, name="ladder-engine", daemon=True)
        self.thread.start()

    def drain(self, timeout_s: float) -> None:
        """Stops admitting, lets running requests finish for up to `timeout_s`, cancels the
        rest (queued ones at once), stops the loop (and the followers)."""
        with self.lock:
            self.admitting = False
            queued, self.queue = list(self.queue), collections.deque()
        for req in queued:
            req.cancelled = True
            req.on_finish("cancelled")
        deadline = time.monotonic() + timeout_s
        while self.busy and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)
        for req in self.owner:
            if req is not None:
                req.cancelled = True
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def _lead_loop(self) -> None:
        try:
            self._lead_steps()
        except BaseException as e:  # a device failure: fail every request, say so in /health
            self.error = f"{type(e).__name__}: {e}"
            with self.lock:
                self.admitting = False
                for i, req in enumerate(self.owner):
                    if req is not None:
                        self._free(i, "error")
                for req in self.queue:
                    req.on_finish("error")
                self.queue.clear()
            raise

    def _lead_steps(self) -> None:
        while True:
            with self.lock:
                while not (self.stopping or self.queue or self.busy):
                    if not self.lock.wait(timeout=self.heartbeat_s) and self.many:
                        break  # a heartbeat for the followers
                plan = self._plan()
            if self.many:
                multihost_utils.broadcast_one_to_all(plan)
            if not self._execute(plan):
                return

    def follow(self) -> None:
        """Processes other than 0: run process 0's plans until it stops."""
        zeros = np.zeros(self._plan_size, np.int32)
        while self._execute(np.asarray(multihost_utils.broadcast_one_to_all(zeros))):
            pass

    def _plan(self) -> np.ndarray:
        """The next iteration as an int32 vector (module docstring); frees cancelled slots and
        pops admitted requests from the queue (called with the lock held)."""
        for i, req in enumerate(self.owner):
            if req is not None and req.cancelled:
                self._free(i, "cancelled")
        B, plan = self.slots, np.zeros(self._plan_size, np.int32)
        plan[0] = 0 if self.stopping else 1
        busy_b = np.array([o is not None for o in self.owner])
        plan[1] = int(busy_b.any()) and not self.stopping
        if plan[1] and any(o is not None and o.logprobs is not None for o in self.owner):
            plan[1] = 2  # the scored decode round
        positions_b = np.where(busy_b, self.length_b + self.count_b - 1, 0)
        s = self.settings
        block = np.stack([self.last, positions_b, s.keys[:, 0].view(np.int32),
                          s.keys[:, 1].view(np.int32), s.temperature.view(np.int32), s.top_k,
                          s.top_p.view(np.int32), self.count_b, busy_b.astype(np.int32)], 1)
        plan[3:3 + 9 * B] = block.reshape(-1)
        free = [i for i in range(B) if self.owner[i] is None]
        n = 0
        while self.queue and free and n < self.admit and not self.stopping:
            req = self.queue.popleft()
            if req.cancelled:
                req.on_finish("cancelled")
                continue
            i = free.pop(0)
            self.owner[i] = req
            r = req.rows
            self.settings.keys[i], self.settings.temperature[i] = r.keys[0], r.temperature[0]
            self.settings.top_k[i], self.settings.top_p[i] = r.top_k[0], r.top_p[0]
            self.length_b[i], self.count_b[i] = len(req.prompt), 0
            o = 3 + 9 * B + n * (_HEAD + self.length)
            plan[o:o + _HEAD] = [i, len(req.prompt), r.keys[0, 0].view(np.int32),
                                 r.keys[0, 1].view(np.int32),
                                 r.temperature[0:1].view(np.int32)[0], r.top_k[0],
                                 r.top_p[0:1].view(np.int32)[0], req.logprobs is not None]
            plan[o + _HEAD:o + _HEAD + len(req.prompt)] = req.prompt
            n += 1
        plan[2] = n
        return plan

    def _execute(self, plan: np.ndarray) -> bool:
        """Runs one plan on this process's devices; process 0 also hands out the tokens.
        False: stop."""
        if plan[0] == 0:
            return False
        B, mesh = self.slots, self.mesh
        block = plan[3:3 + 9 * B].reshape(B, 9)
        rep = P()
        if plan[1]:
            rows = Rows(np.ascontiguousarray(block[:, 2:4]).view(np.uint32),
                        np.ascontiguousarray(block[:, 4]).view(np.float32), block[:, 5].copy(),
                        np.ascontiguousarray(block[:, 6]).view(np.float32))
            args = (to_device(block[:, 0], mesh, rep), to_device(block[:, 1], mesh, rep),
                    rows_to_device(rows, mesh, rep), to_device(block[:, 7], mesh, rep))
            if plan[1] == 2:
                scored, self.cache = self.decoder.decode_steps_scored(
                    self.cache, *args, self.steps_per_plan)
                tokens_kb, *scored = map(to_host, scored)
            else:
                tokens_kb, scored = self._decode_round(*args), None
            self.steps += self.steps_per_plan
            if self.lead:
                for k, tokens in enumerate(tokens_kb):  # a slot freed at step j ignores the
                    for i in range(B):                   # rest of its tokens
                        if block[i, 8] and self.owner[i] is not None:  # busy when planned
                            self._deliver(i, int(tokens[i]), None if scored is None else
                                          tuple(x[k, i] for x in scored))
        if plan[2]:
            self._prefill(plan, int(plan[2]))
        return True

    def _prefill(self, plan: np.ndarray, n: int) -> None:
        """The plan's n admitted prompts into their slots, one program per prompt bucket
        among them (several prompts of a bucket share one; a power-of-two count of rows, the
        padding rows naming slot `slots`, past the cache: computed, never written), then
        their first tokens handed out, in the plan's order."""
        B, mesh, rep = self.slots, self.mesh, P()
        offsets = [3 + 9 * B + j * (_HEAD + self.length) for j in range(n)]
        groups: dict[int, list[int]] = {}
        for o in offsets:
            groups.setdefault(prompt_bucket(int(plan[o + 1]), self.length), []).append(o)
        first: dict[int, tuple] = {}  # offset -> (first token, its scores or None)
        for T, group in groups.items():
            N = prefill_group(len(group))
            slots_n = np.full(N, B, np.int32)
            tokens_nt, lengths_n = np.zeros((N, T), np.int32), np.ones(N, np.int32)
            rows = Rows.empty(N)
            for j, o in enumerate(group):
                h, length = plan[o:o + _HEAD], int(plan[o + 1])
                slots_n[j], lengths_n[j] = h[0], length
                tokens_nt[j, :length] = plan[o + _HEAD:o + _HEAD + length]
                rows.keys[j] = h[2:4].view(np.uint32)
                rows.temperature[j] = h[4:5].view(np.float32)[0]
                rows.top_k[j], rows.top_p[j] = h[5], h[6:7].view(np.float32)[0]
            args = (self.cache, to_device(slots_n, mesh, rep), to_device(tokens_nt, mesh, rep),
                    to_device(lengths_n, mesh, rep), rows_to_device(rows, mesh, rep))
            if any(plan[o + 7] for o in group):  # some request wants logprobs
                scored, self.cache = self.decoder.prefill_slots_scored(*args)
                first_n, *scored = map(to_host, scored)
            else:
                first_n, self.cache = self.decoder.prefill_slots(*args)
                first_n, scored = to_host(first_n), None
            for j, o in enumerate(group):
                first[o] = int(first_n[j]), None
                if scored is not None and self.lead:
                    first[o] = int(first_n[j]), self._score_prompt(
                        int(plan[o]), int(plan[o + 1]), *(x[j] for x in scored))
        if self.lead:
            for o in offsets:
                self._deliver(int(plan[o]), *first[o])

    def _decode_round(self, tokens_b, positions_b, rows, token_b) -> np.ndarray:
        """One round's decode steps on the device (one program) -> their tokens (k, B) on the
        host; the cache is updated in place."""
        if self.steps_per_plan == 1:
            tokens_b, self.cache = self.decoder.decode_step(self.cache, tokens_b, positions_b,
                                                            rows, token_b)
            return to_host(tokens_b)[None]
        tokens_kb, self.cache = self.decoder.decode_steps(self.cache, tokens_b, positions_b,
                                                          rows, token_b, self.steps_per_plan)
        return to_host(tokens_kb)

    def _deliver(self, i: int, token: int, scored=None) -> None:
        req = self.owner[i]
        if req.cancelled:
            with self.lock:
                self._free(i, "cancelled")
            return
        if token == NONFINITE:  # broken weights: no token drawn from NaN logits is given
            with self.lock:
                self._free(i, "nonfinite")
            return
        if req.max_tokens == 0:  # scored the prompt only
            with self.lock:
                self._free(i, "length")
            return
        if req.logprobs is not None and scored is not None:
            lp, ids, lps = scored
            n = req.logprobs
            req.scores.append((float(lp), ids[:n].tolist(), lps[:n].tolist()))
        self.count_b[i] += 1
        self.last[i] = token
        if token == req.eos_id and req.eos_id is not None:
            with self.lock:
                self._free(i, "stop")
            return
        req.on_token(token)
        if self.count_b[i] >= req.max_tokens:
            with self.lock:
                self._free(i, "length")

    def _score_prompt(self, i: int, length: int, lp_t, ids_tk, lps_tk):
        """Sets an echo request's `prompt_scores` (tokens 1..length-1, from positions
        0..length-2) from one row of a scored prefill; returns its first token's scores."""
        req = self.owner[i]
        if req is not None and req.echo and req.logprobs is not None:
            n = req.logprobs
            req.prompt_scores = [(float(lp_t[t]), ids_tk[t, :n].tolist(),
                                  lps_tk[t, :n].tolist()) for t in range(length - 1)]
        return lp_t[length - 1], ids_tk[length - 1], lps_tk[length - 1]

    def _free(self, i: int, reason: str) -> None:
        req, self.owner[i] = self.owner[i], None
        self.settings.temperature[i], self.settings.top_k[i] = 0, 0
        self.count_b[i], self.last[i], self.length_b[i] = 0, 0, 0
        req.on_finish(reason)

    # -- compile ahead ------------------------------------------------------------------------

    def warmup_programs(self) -> list[tuple[int, int]]:
        """What `warmup` compiles, in order: (rows, prompt tokens) of each prefill program, then
        (slots, 0) for the decode round."""
        buckets = sorted({prompt_bucket(n, self.length) for n in range(1, self.length + 1)})
        groups = sorted({prefill_group(n) for n in range(1, self.admit + 1)})
        return [(N, T) for N in groups for T in buckets] + [(self.slots, 0)]

    def warmup(self, progress=None) -> None:
        """Compiles the decode round and every prefill program (each prompt bucket x each
        admission group size, `warmup_programs`), on every process, before serving: prefills
        run on padding rows only (nothing is written), the decode round on free slots.
        `progress(k, n)` is called after the k-th of the n programs has compiled."""
        rep, mesh = P(), self.mesh
        programs = self.warmup_programs()
        for k, (N, T) in enumerate(programs, 1):
            if T:
                rows = rows_to_device(Rows.empty(N), mesh, rep)
                first, self.cache = self.decoder.prefill_slots(
                    self.cache, to_device(np.full(N, self.slots, np.int32), mesh, rep),
                    to_device(np.zeros((N, T), np.int32), mesh, rep),
                    to_device(np.ones(N, np.int32), mesh, rep), rows)
                to_host(first)
            else:
                z = to_device(np.zeros(self.slots, np.int32), mesh, rep)
                self._decode_round(z, z, rows_to_device(Rows.empty(self.slots), mesh, rep), z)
            if progress is not None:
                progress(k, len(programs))
