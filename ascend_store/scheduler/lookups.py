"""The scheduler's pool lookups, off the engine's thread.

vLLM asks ``get_num_new_matched_tokens`` of each waiting request while it schedules a step;
a pool call there would put the network (and a hung pool's whole timeout) on the critical
path of every request, hits or not. So:
- a request whose chunks the hit cache knows is answered at once, with no call;
- otherwise its questions join the step's batch and vLLM is told "not yet" (None: it
  skips the request this step and asks again next step);
- at the end of the step's scheduling (``flush``, from ``build_connector_meta``) the batch
  of every request asked in the step goes to a background thread as one ``exists`` call,
  keys shared by several requests asked once: at most one lookup call per step;
- while a request waits for its answer vLLM often has nothing else to run and loops
  through empty steps on the GIL; the scheduler yields the GIL when it hands the thread a
  batch and at each step's first lookup (twice a step at most: a yield can cost the
  scheduler the thread's Python work), so the thread sends the question and takes the
  reply at once instead of after the interpreter's 5 ms switch interval each time;
- a request not answered within ``lookup_timeout_s`` of its first ask is a miss (until the
  pool first answers, within ``first_deadline_s``: an engine's first requests come right
  after it starts, while a store client may still be connecting);
- while the pool is known to be down (its circuit breaker is open, or the thread has been
  stuck in a call longer than that deadline) requests miss at once, without asking, and
  cached hits are not trusted either: their loads would wait on the same pool.

What a request asks, from ``start`` (its first chunk past vLLM's device-cache hit): every
chunk up to the first the cache knows missing and, for hybrid models, the recurrent state at
each of their ends; and the prompt's partial last chunk cut after 1, 2, ... blocks (its tail
objects) at the two places a hit usually ends: at ``start`` (nothing more in the pool) and
after the last full chunk (all of it). A hit ending anywhere else asks its tails in a
second round, a step later.

An answer is the tier that holds an entry's objects (``Backend.tiers``: 0 for a miss, the
slowest of them when a chunk has several), kept in the hit cache as it is, so the load
planner can price each chunk of a hit; ``promoted`` marks what a load brings into memory.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ascend_store.backends import BackendUnavailable
from ascend_store.common.keys import KeySpace
from ascend_store.scheduler.hit_cache import BlockHitCache

STATE_TAG = "state/"  # cache entries of a chunk's recurrent state (hybrid models)
TAIL_TAG = "tail/"  # cache entries of a prompt's partial last chunk


@dataclass
class Ask:
    """One request's questions: (cache entry, chunk hash, KV cache groups) each. The lookup
    thread fills ``reply``/``reply_failed``; the scheduler's thread copies them to
    ``answer``/``failed`` for a whole batch at once, at the start of a step, so that the
    requests asked together are answered in the same step (and load together)."""

    start: int
    entries: list[tuple[str, str, tuple[int, ...]]]
    asked_at: float
    answer: dict[str, int] | None = None  # entry -> its tier (0: a miss)
    failed: bool = False
    reply: dict[str, int] | None = None
    reply_failed: bool = False


@dataclass
class Hit:
    chunks: int  # leading chunks the pool serves (from 0)
    tail: tuple[str, int] | None = None  # (partial hash, blocks) served past them
    tiers: tuple[int, ...] = ()  # the tier of each chunk from the request's start, then the tail's


@dataclass
class LookupState:
    """What one request's lookup carries from step to step."""

    ask: Ask | None = None
    answers: dict[str, int] = field(default_factory=dict)


class PoolLookups:
    def __init__(self, backend, keyspaces: list[KeySpace], attn_groups: list[int], state_groups: list[int],
                 hit_cache: BlockHitCache | None, counters, deadline_s: float, events=None,
                 first_deadline_s: float | None = None):
        self.backend = backend
        self.keyspaces = keyspaces
        self.attn = tuple(attn_groups)
        self.state = tuple(state_groups)
        self.cache = hit_cache
        self.counters = counters
        self.deadline_s = deadline_s
        self.first_deadline_s = max(deadline_s, first_deadline_s or deadline_s)
        self._answered = False  # the pool has answered a lookup since the engine started
        self.events = events  # kv_events.KVEventFeed: fetched on the same thread, once per step
        self._batch: list[Ask] = []  # asked this step
        self._sent: list[Ask] = []  # answered or in flight, not yet folded into the cache
        self._promoted: set[str] = set()  # entries loaded since the last fold (now in memory)
        self._work = threading.Condition()
        self._queued: list[Ask] | None = None  # handed to the thread, not yet taken
        self._busy_since: float | None = None  # when the thread's current call started
        self._replies = threading.Lock()  # a batch's replies are written and published whole
        self._now: float | None = None  # the step's clock, taken at its first lookup
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- the scheduler's thread -------------------------------------------------
    def lookup(self, st: LookupState, hashes: list[str], start: int, limit: int, tails) -> Hit | None:
        """The pool's hit for a request (None: not known yet, ask again next step).
        ``tails(c)``: the hashes of chunk ``c`` cut after 1, 2, ... blocks."""
        if self._now is None:  # the step's first lookup
            self._now = time.monotonic()
            time.sleep(0)  # the thread may be waiting for the GIL to take its reply
            self._publish()
        ask, now = st.ask, self._now
        if ask is not None and ask.start != start:  # asked again from elsewhere (a preemption)
            ask, st.ask, st.answers = None, None, {}
        if ask is not None:
            if ask.answer is None and not ask.failed:
                if now - ask.asked_at < self._deadline():
                    return None
                self.counters["lookup_timeouts"] += 1
            st.ask = None
            if ask.answer is None:
                st.answers = {}
                return Hit(start)
            st.answers.update(ask.answer)
        elif not self.available(now):
            self.counters["lookups_skipped"] += 1
            return Hit(start)
        self.counters["lookups"] += 1
        if self.cache is not None:
            self.cache.observe(self.backend.generation())
        hit, todo = self._resolve(st, hashes, start, limit, tails)
        if not todo:
            st.answers = {}
            return hit
        st.ask = Ask(start, todo, now)
        self._batch.append(st.ask)
        return None

    def _known(self, st: LookupState, entry: str) -> int | None:
        if entry in st.answers:
            return st.answers[entry]
        return self.cache.get(entry) if self.cache is not None else None

    def _resolve(self, st: LookupState, hashes: list[str], start: int, limit: int, tails):
        """The hit as far as the answers and the cache tell, and what must still be asked."""
        todo, n = [], len(hashes)
        prefix = start
        for c in range(start, n):  # chunks, and their state, up to the first known miss
            known = self._known(st, hashes[c])
            if known == 0:
                break
            if known is None:
                todo.append((hashes[c], hashes[c], self.attn))
            if self.state and self._known(st, STATE_TAG + hashes[c]) is None:
                todo.append((STATE_TAG + hashes[c], hashes[c], self.state))
            if known and prefix == c:
                prefix += 1
        places = {start, n} if todo else {min(prefix, limit)}
        if self.state:  # a hybrid hit ends where the state was saved; no tails
            places = set()
        for c in sorted(places):
            todo += [(TAIL_TAG + h, h, self.attn) for h in tails(c) if self._known(st, TAIL_TAG + h) is None]
        if todo:
            return None, todo
        prefix = min(prefix, limit)
        if self.state:
            prefix = next((c + 1 for c in range(prefix - 1, start - 1, -1)
                           if self._known(st, STATE_TAG + hashes[c])), start)
            prefix = max(prefix, start)
            return Hit(prefix, tiers=self._tiers(st, hashes, start, prefix, STATE_TAG)), []
        best = None  # the longest tail the pool holds
        for k, h in enumerate(tails(prefix), 1):
            if self._known(st, TAIL_TAG + h):
                best = (h, k)
        tiers = self._tiers(st, hashes, start, prefix, "")
        if best is not None:
            tiers += (self._known(st, TAIL_TAG + best[0]),)
        return Hit(prefix, best, tiers), []

    def _tiers(self, st: LookupState, hashes: list[str], start: int, end: int, state: str) -> tuple[int, ...]:
        """The tier of chunks [start, end) (with ``state``: the slower of each chunk's KV and
        recurrent state; a hybrid hit ends where the state was saved)."""
        out = tuple(self._known(st, h) or 1 for h in hashes[start:end])
        if state and end > start:
            out = out[:-1] + (max(out[-1], self._known(st, state + hashes[end - 1]) or 1),)
        return out

    def promoted(self, entries: list[str]) -> None:
        """Entries a load is about to lease: a lease brings an object into the pool's memory."""
        if self.cache is not None:
            self.cache.promote(entries)
            self._promoted.update(entries)  # their answer may reach the cache at the next flush

    def available(self, now: float | None = None) -> bool:
        """Whether asking may help: the breaker is closed and the thread is not stuck."""
        busy = self._busy_since
        now = time.monotonic() if now is None else now
        return self.backend.available() and (busy is None or now - busy < self._deadline())

    def _deadline(self) -> float:
        return self.deadline_s if self._answered else self.first_deadline_s

    def flush(self) -> int:
        """End of the step's scheduling: hand the step's questions (and, with KV events on,
        an events fetch) to the thread, fold answered ones into the cache. Returns the pool
        calls this starts (at most one lookup); questions wait a step while the thread is busy."""
        self._now = None  # the next step takes its own clock
        self._publish()  # between steps: what came in during this one, so the cache gets it now
        self._fold()
        want_events = self.events is not None
        if not (self._batch or want_events) or self._closed:
            return 0
        with self._work:
            if self._queued is not None or self._busy_since is not None:
                return 0
            batch, self._batch = self._batch, []
            self._sent += batch
            self._queued = batch
            self._work.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ascend-store-lookup", daemon=True)
            self._thread.start()
        time.sleep(0)  # hand the GIL to the thread now, not after the interpreter's 5 ms switch interval
        return 1 if batch else 0

    def _publish(self) -> None:
        """Replies that have come in since the last step become answers, batch by batch."""
        with self._replies:
            for ask in self._sent:
                if ask.answer is None and not ask.failed:
                    ask.answer, ask.failed = ask.reply, ask.reply_failed

    def _fold(self) -> None:
        """Answers in the hit cache (on this thread: the cache is not shared)."""
        waiting = []
        for ask in self._sent:
            if ask.answer is not None:
                if self.cache is not None:
                    self.cache.observe(self.backend.generation())
                    for entry, hit in ask.answer.items():
                        self.cache.put(entry, hit)
            elif not ask.failed:
                waiting.append(ask)
        self._sent = waiting
        if self._promoted:
            self.cache.promote(self._promoted)
            self._promoted.clear()

    def forget(self, st: LookupState) -> None:
        st.ask, st.answers = None, {}

    def close(self) -> None:
        with self._work:
            self._closed = True
            self._work.notify()

    # -- the lookup thread ------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._work:
                while self._queued is None and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                batch, self._queued = self._queued, None
                self._busy_since = time.monotonic()
            try:
                if batch:
                    self._ask(batch)
                if self.events is not None:
                    self.events.fetch()
            finally:
                self._busy_since = None

    def _ask(self, batch: list[Ask]) -> None:
        """One ``exists`` for every question of the batch, each key once."""
        index: dict[str, int] = {}
        per_entry = []
        for ask in batch:
            for entry, chunk, groups in ask.entries:
                keys = [ks.key(g, chunk) for ks in self.keyspaces for g in groups]
                per_entry.append([index.setdefault(k, len(index)) for k in keys])
        self.counters["lookup_rpcs"] += 1
        t0 = time.perf_counter()
        try:
            found = self.backend.tiers(list(index))
        except BackendUnavailable:
            self.counters["lookup_errors"] += 1
            with self._replies:
                for ask in batch:
                    ask.reply_failed = True
            return
        finally:
            self.counters["lookup_seconds"] += time.perf_counter() - t0
        it = iter(per_entry)
        replies = []
        for ask in batch:
            reply = {}
            for entry, _, _ in ask.entries:
                tiers = [found[i] for i in next(it)]
                reply[entry] = min(tiers) and max(tiers)  # 0 when any object is missing
            replies.append(reply)
        self._answered = True
        with self._replies:
            for ask, reply in zip(batch, replies):
                ask.reply = reply
