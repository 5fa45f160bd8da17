"""How long each step took on this worker, for the scheduler's load planner (planner.py):
from the step's first hook (its loads' start where they start as the scheduler builds the
step, else ``handle_preemptions``, or ``start_load_kv`` where vLLM calls neither) to the
end of its forward (``wait_for_save``), by the step number the scheduler put in its
metadata. Host time: on an accelerator the step's end is when the
forward's last layer was queued and its loads waited for."""

from __future__ import annotations

import time

from ascend_store.common.metadata import StepMetadata


class StepTimer:
    def __init__(self):
        self._step = 0
        self._start: float | None = None
        self._done: dict[int, float] = {}

    def begin(self, meta) -> None:
        if isinstance(meta, StepMetadata) and meta.step and meta.step != self._step:
            self._step, self._start = meta.step, time.perf_counter()

    def end(self, meta) -> None:
        if isinstance(meta, StepMetadata) and meta.step == self._step and self._start is not None:
            self._done[self._step] = time.perf_counter() - self._start
            self._start = None

    def take(self) -> dict[int, float]:
        done, self._done = self._done, {}
        return done
