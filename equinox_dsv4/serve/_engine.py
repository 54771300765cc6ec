"""Continuous batching: a fixed number of cache rows ("slots") shared by requests that come and
go, one jitted step at a time.

A request takes a free row; its prompt runs into that row in chunks of `chunk` tokens, between
decode steps of the rows already generating; each decode step appends one token to every
generating row and samples the next with that row's own sampling and PRNG stream. A finished
or cancelled row is free at once: the next request's first chunk sets the row's position back
to 0, and the positional cache ignores whatever the row held beyond it. Every step has the
same shapes (`[slots, chunk]`, `[slots, 1]`), so nothing compiles after the first step of each
kind, whatever the mix of prompts.

The engine runs its loop in a thread of its own; a request's tokens reach its owner through
the request's `on_token` / `on_finish` callbacks, called from that thread.

With a drafter (`speculative="mtp"` or `"dspark"`), the prefill steps also feed the drafter and
draft after each prompt's last token, and a decode step is `inference.speculative_step` over
all rows: it verifies each generating row's drafts and drafts again, with that row's sampling
(`SamplingRows`), giving the row 1 .. depth + 1 tokens. The drafter's state has the cache's
rows.
"""

import contextlib
import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ..inference import AbstractDrafter, SamplingRows, drafter_for
from ..nn import DeepseekV4, KVCache
from ..parallel import committed, shard_cache
from ._steps import (
    decode_step,
    prefill_step,
    rows_of,
    speculative_decode_step,
    speculative_prefill_step,
)


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is at its bound: try again later."""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation: `ids` (the prompt), at most `max_new_tokens` new tokens, stopping at any of
    `stop_tokens` (not passed on), sampled with `temperature` (0: greedy), `top_k` (0: all),
    `top_p` from the PRNG stream of `seed`.

    The engine calls `on_token(id)` for each new token and then `on_finish(reason)` once:
    `"stop"` (a stop token), `"length"` (`max_new_tokens`, or the row's cache is full) or
    `"cancelled"`."""

    ids: Sequence[int]
    max_new_tokens: int
    on_token: Callable[[int], None]
    on_finish: Callable[[str], None]
    stop_tokens: frozenset[int] = frozenset()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # Set by the engine.
    slot: int | None = None
    prefilled: int = 0
    produced: int = 0
    pending: int | None = None
    cancelled: bool = False
    finished: bool = False

    def finish(self, reason: str) -> None:
        """`on_finish(reason)`, once."""
        if not self.finished:
            self.finished = True
            self.on_finish(reason)


class Engine:
    """Continuous batching over `slots` rows of one cache of `max_len` tokens per row.

    **Arguments:**

    - `model`: the model (on one device, or sharded: the cache is placed on its mesh).
    - `slots`: rows generating at once.
    - `max_len`: tokens per row: prompt plus generated.
    - `chunk`: prompt tokens per prefill step.
    - `prefill_rows`: rows a prefill step runs at most (the others wait for the next one); a
      step runs on the smallest power of two (or `prefill_rows`) that holds the rows reading,
      one compiled program each.
    - `max_waiting`: requests waiting for a row beyond which `submit` raises `QueueFull`.
    - `speculative`: `None`, or the drafter that drafts for every row (`"mtp"`, `"dspark"`, an
      `AbstractDrafter`: as `generate`'s argument); each row's tokens are those plain decoding
      gives it (greedy) or distributed as they are (sampling).

    `start()` runs the loop in a thread; `submit(request)` queues a request; `cancel(request)`
    frees its row within one step; `stop()` cancels everything and ends the thread.
    """

    def __init__(
        self,
        model: DeepseekV4,
        *,
        slots: int = 8,
        max_len: int = 4096,
        chunk: int = 256,
        prefill_rows: int = 4,
        max_waiting: int = 64,
        speculative: str | AbstractDrafter | None = None,
    ):
        checked = (("slots", slots), ("max_len", max_len), ("chunk", chunk))
        for name, value in checked + (("prefill_rows", prefill_rows),):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        sharding = getattr(model.embed.weight, "sharding", None)
        self.mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        self.model = model if self.mesh is not None else committed(model)
        self.policy = model.resolved_policy()
        self.slots, self.max_len, self.chunk, self.max_waiting = slots, max_len, chunk, max_waiting
        self.lanes = min(prefill_rows, slots)
        # The prefill step's sizes: powers of two below `lanes`, and `lanes`; a step takes the
        # smallest that holds the rows reading (one compiled program per size).
        self.sizes = sorted({1 << i for i in range(self.lanes.bit_length())} | {self.lanes})
        self.sizes = [n for n in self.sizes if n <= self.lanes]
        self.drafter = None if speculative is None else drafter_for(model, speculative)
        self.depth = 0 if self.drafter is None else self.drafter.depth(model)
        # Room for the drafts verified past a row's last kept token.
        rows = self.max_len + self.depth
        self.cache = self._place(model.init_cache(slots, rows, rewind=self.depth))
        self.drafts = None
        if self.drafter is not None:
            drafts = self.drafter.init(model, slots, rows, rows_of(slots), self._place)
            self.drafts = drafts if self.mesh is not None else committed(drafts)
        self.rows: list[Request | None] = [None] * slots
        self.waiting: deque[Request] = deque()
        self.lock = threading.Condition()
        self.running = False
        self.thread: threading.Thread | None = None
        # Steps run, and tokens produced, for the health report and the benchmark.
        self.counts = {"prefill_steps": 0, "decode_steps": 0, "tokens": 0}
        if self.drafter is not None:
            # Drafts verified for generating rows, and how many were accepted.
            self.counts.update(drafted=0, accepted=0)
        self.error: BaseException | None = None
        self.warm = self.stopping = False

    # -- the owner's side ---------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue `request` for the next free row. Raises `ValueError` for a prompt that leaves
        no room in a row, `QueueFull` when `max_waiting` requests already wait."""
        if not request.ids:
            raise ValueError("the prompt is empty")
        if len(request.ids) >= self.max_len:
            raise ValueError(
                f"the prompt has {len(request.ids)} tokens; this server's rows hold "
                f"{self.max_len} (--max-len), prompt and reply together"
            )
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        vocab = self.model.config.vocab_size
        bad = next((t for t in request.ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is not in the model's vocabulary of {vocab}")
        # int32 on the device: a top_k beyond the vocabulary filters nothing.
        request.top_k = min(max(request.top_k, 0), vocab)
        with self.lock:
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error!r}")
            if self.stopping:
                raise RuntimeError("the server is shutting down")
            # Waiting beyond the free rows (which the loop fills next) is bounded.
            if len(self.waiting) >= self.max_waiting + self.rows.count(None):
                raise QueueFull(f"{self.slots} requests running and {len(self.waiting)} waiting")
            self.waiting.append(request)
            self.lock.notify()

    def cancel(self, request: Request) -> None:
        """Stop `request` (its row is freed within one step; `on_finish("cancelled")` follows
        unless it had finished)."""
        with self.lock:
            request.cancelled = True
            self.lock.notify()

    def health(self) -> dict[str, int]:
        with self.lock:
            busy = sum(r is not None for r in self.rows)
            return {
                "slots": self.slots,
                "busy": busy,
                "free": self.slots - busy,
                "waiting": len(self.waiting),
                **self.counts,
            }

    def start(self) -> "Engine":
        """Compile both steps (so that the first request waits for no compilation), then run the
        loop in a daemon thread."""
        if not self.warm:
            self.warm_up()
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="equinox_dsv4-engine", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """Cancel every request and end the loop's thread; later `submit`s raise."""
        with self.lock:
            self.running, self.stopping = False, True
            for r in [*self.waiting, *self.rows]:
                if r is not None:
                    r.cancelled = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join()
        with self.lock:
            left = [r for r in [*self.waiting, *self.rows] if r is not None]
            self.waiting.clear()
            self.rows = [None] * self.slots
        for r in left:
            r.finish("cancelled")

    def warm_up(self) -> None:
        """Run each prefill step and the decode step, touching no row (every count 0), under
        the mesh the loop runs in (part of what a compiled program is for)."""
        with self._mesh():
            self._warm_up()

    def _mesh(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _place(self, cache: KVCache) -> KVCache:
        # Committed, as the steps' outputs are (the model is): the warm-up then compiles the
        # programs every later step runs, not ones for a fresh uncommitted cache.
        return committed(cache) if self.mesh is None else shard_cache(cache, self.mesh)

    def _warm_up(self) -> None:
        for n in self.sizes:
            zeros = np.zeros(n, np.int32)
            ids = np.zeros((n, self.chunk), np.int32)
            ahead = np.zeros((n, self.chunk + self.depth), np.int32)
            self._prefill(ids, ahead, zeros, zeros, np.arange(n, dtype=np.int32))
        self._decode(np.zeros(self.slots, np.int32), np.zeros(self.slots, np.int32))
        self.warm = True

    # -- the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with self._mesh():
                while True:
                    with self.lock:
                        self._admit()
                        if not self.running:
                            return
                        if all(r is None for r in self.rows):
                            self.lock.wait(timeout=0.5)
                            continue
                    self._iterate()
        except BaseException as e:  # the owner sees it in `health`/`submit`; rows are told
            with self.lock:
                self.error = e
                failed = [r for r in [*self.waiting, *self.rows] if r is not None]
                self.waiting.clear()
                self.rows = [None] * self.slots
            for r in failed:
                r.finish("error")
            raise

    def _admit(self) -> None:
        # Under the lock: cancelled requests out (waiting ones too, which count towards the
        # queue's bound), waiting ones into free rows.
        for slot, r in enumerate(self.rows):
            if r is not None and r.cancelled:
                self.rows[slot] = None
                r.finish("cancelled")
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            r.finish("cancelled")
        while self.waiting and None in self.rows:
            r = self.waiting.popleft()
            if r.cancelled:
                r.finish("cancelled")
                continue
            r.slot = self.rows.index(None)
            self.rows[r.slot] = r

    def _iterate(self) -> None:
        # One prefill step when a row is still reading its prompt, then one decode step for the
        # rows generating.
        rows = list(self.rows)
        reading = [r for r in rows if r is not None and r.pending is None][: self.lanes]
        if reading:
            lanes = next(n for n in self.sizes if n >= len(reading))
            ids = np.zeros((lanes, self.chunk), np.int32)
            # The tokens after each of the chunk's (the drafter is fed them).
            ahead = np.zeros((lanes, self.chunk + self.depth), np.int32)
            remaining = np.zeros(lanes, np.int32)
            fresh = np.zeros(lanes, np.int32)
            # The reading rows' lanes first; the others hold distinct rows left as they are.
            used = [r.slot for r in reading]
            index = used + [s for s in range(self.slots) if s not in used]
            index = np.asarray(index[:lanes], np.int32)
            for lane, r in enumerate(reading):
                part = r.ids[r.prefilled : r.prefilled + self.chunk]
                ids[lane, : len(part)] = part
                after = r.ids[r.prefilled + 1 : r.prefilled + 1 + self.chunk + self.depth]
                ahead[lane, : len(after)] = after
                remaining[lane] = len(r.ids) - r.prefilled
                fresh[lane] = r.prefilled == 0
            first = self._prefill(ids, ahead, remaining, fresh, index)
            for lane, r in enumerate(reading):
                r.prefilled += min(int(remaining[lane]), self.chunk)
                if r.prefilled == len(r.ids):
                    self._take(r, int(first[lane]))
        generating = [r for r in self.rows if r is not None and r.pending is not None]
        if generating:
            pending = np.zeros(self.slots, np.int32)
            active = np.zeros(self.slots, np.int32)
            for r in generating:
                pending[r.slot], active[r.slot] = r.pending, 1
            tokens, counts = self._decode(pending, active)
            for r in generating:
                if self.drafter is not None:
                    self.counts["drafted"] += self.depth
                    self.counts["accepted"] += int(counts[r.slot]) - 1
                for token in tokens[r.slot, : counts[r.slot]]:
                    if self._take(r, int(token)):
                        break

    def _take(self, r: Request, token: int) -> bool:
        # A new token for `r`: passed on, or the end of `r` (its row freed; returns True).
        self.counts["tokens"] += 1
        reason = None
        if r.cancelled:
            reason = "cancelled"
        elif token in r.stop_tokens:
            reason = "stop"
        else:
            r.produced += 1
            r.on_token(token)
            # The token is appended to the cache by the next step: room for it is needed.
            if r.produced >= r.max_new_tokens or len(r.ids) + r.produced >= self.max_len:
                reason = "length"
        if reason is None:
            r.pending = token
            return False
        with self.lock:
            self.rows[r.slot] = None
        r.finish(reason)
        return True

    def _sampling(self, index: np.ndarray | None = None) -> tuple[SamplingRows, np.ndarray]:
        # Each row's sampling (of rows `index` only, if given), and its PRNG stream's position
        # (its request's seed, and the number of tokens it has drawn: a request draws the same
        # tokens in any row and beside any others).
        temperature = np.zeros(self.slots, np.float32)
        top_k = np.zeros(self.slots, np.int32)
        top_p = np.ones(self.slots, np.float32)
        seeds = np.zeros((self.slots, 2), np.int32)
        for r in self.rows:
            if r is not None:
                temperature[r.slot], top_k[r.slot], top_p[r.slot] = r.temperature, r.top_k, r.top_p
                seeds[r.slot] = (r.seed % 2**31, r.produced)
        rows = slice(None) if index is None else index
        sampling = SamplingRows(*(jnp.asarray(a[rows]) for a in (temperature, top_k, top_p)))
        return sampling, seeds[rows]

    def _prefill(
        self,
        ids: np.ndarray,
        ahead: np.ndarray,
        remaining: np.ndarray,
        fresh: np.ndarray,
        index: np.ndarray,
    ) -> np.ndarray:
        self.counts["prefill_steps"] += 1
        sampling, seeds = self._sampling(index)
        if self.drafter is None:
            counts = np.minimum(remaining, self.chunk)
            token, self.cache = prefill_step(
                self.model, self.policy, ids, counts, fresh, index, self.cache, sampling, seeds
            )
        else:
            token, self.cache, self.drafts = speculative_prefill_step(
                self.model,
                self.policy,
                self.drafter,
                ids,
                ahead,
                remaining,
                fresh,
                index,
                self.cache,
                self.drafts,
                sampling,
                seeds,
            )
        return np.asarray(token)

    def _decode(self, pending: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Each row's new tokens, `tokens[b, :counts[b]]`.
        self.counts["decode_steps"] += 1
        sampling, seeds = self._sampling()
        if self.drafter is None:
            token, self.cache = decode_step(
                self.model, self.policy, pending, active, self.cache, sampling, seeds
            )
            return np.asarray(token)[:, None], active
        tokens, counts, self.cache, self.drafts = speculative_decode_step(
            self.model,
            self.policy,
            self.drafter,
            pending,
            active,
            self.cache,
            self.drafts,
            sampling,
            seeds,
        )
        return jax.device_get((tokens, counts))
