"""Compacted requests: a token-eviction method (TriAttention, SnapKV-style) rewrites a
request's KV, which then no longer matches the token prefix its ids hash to, so the
scheduler never publishes it under prefix keys (docs/codecs.md, docs/ascend.md).

Two marks say a request is compacted:
- ours, the contract any method can follow: ``kv_compacted: True`` on the request
  (``is_compacted``);
- the TriAttention plugin's (vllm-ascend-kvcompress-hust): its plans on the scheduler
  output (``CompactionPlans``), which the scheduler keeps on its request record.
"""

from __future__ import annotations

from ascend_store.scheduler.marks import COMPACTED, marked

# The plugin's attribute for its plans, {request id: plan}, on vLLM's scheduler output
# (transaction.PLAN_ATTRIBUTE; tests/contract/test_ascend_plugins.py checks they match).
KVCOMPRESS_PLANS = "_ascend_kvcompress_plans_v4"


def is_compacted(request) -> bool:
    """Our mark: ``kv_compacted: True`` on the request (marks.py), read at every save plan."""
    return marked(request, COMPACTED)


class CompactionPlans:
    """The plugin's mark. It attaches a step's plans once vLLM's schedule() returns, i.e.
    after this connector built that step's metadata, so they are read at the next step,
    from the output kept here. This step's output is read too, for plans attached before
    the connector's call."""

    def __init__(self) -> None:
        self._last_output = None  # the previous step's scheduler output

    def planned(self, scheduler_output) -> set[str]:
        """Ids of the requests planned for compaction on the previous or this step's output."""
        ids = {rid for out in (self._last_output, scheduler_output)
               for rid in getattr(out, KVCOMPRESS_PLANS, None) or ()}
        self._last_output = scheduler_output
        return ids
