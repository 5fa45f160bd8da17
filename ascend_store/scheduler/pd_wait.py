"""P/D, consumer side: a decode request waits for the producer's objects (``consumer_wait_s``).

deploy/proxy.py sends a request to decode the moment prefill answers and marks it
``kv_transfer_params: {"ascend_store_prefilled": true}``: a producer computed this prompt
and its objects are on their way. A producer that holds its reply until its commit
(``commit_before_reply``, the default) makes the wait unnecessary; one that does not (a
producer configured otherwise, or a proxy that sends to decode before prefill answers)
leaves a window in which decode finds only part of the prompt and recomputes the rest.

With ``consumer_wait_s`` > 0, a marked request whose pool hit is short of what the
producer stores (the prompt's whole blocks, less the token vLLM computes itself) is
answered "not known yet": vLLM skips it for this step and asks again at the next, while
the other requests run. The pool is asked at most once per ``POLL_S`` per request; past
the deadline the request goes on with what the pool holds (a short hit costs recompute,
never a wrong token). Unmarked requests never wait.
"""

from __future__ import annotations

import time

PREFILLED = "ascend_store_prefilled"
POLL_S = 0.005  # between pool lookups of one waiting request: the engine loop spins while it waits


def is_prefilled(request) -> bool:
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get(PREFILLED))


class ProducerWait:
    def __init__(self, wait_s: float, counters, clock=time.monotonic):
        self.wait_s = wait_s
        self.counters = counters
        self._clock = clock
        self._waiting: dict[str, tuple[float, float]] = {}  # request id -> (deadline, next poll)
        self._done: set[str] = set()  # waited once: asked again (no room yet, preempted), no new wait

    def holds(self, request, hit_tokens: int, want_tokens: int) -> bool:
        """Whether a request whose pool hit now reaches ``hit_tokens`` waits for more: the
        producer's objects reach ``want_tokens``."""
        if self.wait_s <= 0 or request.request_id in self._done or not is_prefilled(request):
            return False
        return self._keep_waiting(request.request_id, hit_tokens, want_tokens)

    def too_soon(self, req_id: str) -> bool:
        """A waiting request asked again before its next poll: answer "not yet" without
        asking the pool."""
        got = self._waiting.get(req_id)
        return got is not None and self._clock() < got[1]

    def _keep_waiting(self, req_id: str, hit_tokens: int, want_tokens: int) -> bool:
        """Whether the request should wait for more of its prompt's objects."""
        now = self._clock()
        deadline = self._waiting.get(req_id, (now + self.wait_s, now))[0]
        if hit_tokens >= want_tokens or now >= deadline:
            self._done.add(req_id)
            if self._waiting.pop(req_id, None) is not None:
                self.counters["producer_waits"] += 1
                if hit_tokens < want_tokens:
                    self.counters["producer_wait_timeouts"] += 1
            return False
        self._waiting[req_id] = (deadline, now + POLL_S)
        return True

    def forget(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
        self._done.discard(req_id)
