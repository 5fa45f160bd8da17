"""Marks a request carries for the connector: ``{key: true}`` in its ``kv_transfer_params``
or in its sampling params' ``extra_args`` (``SamplingParams(extra_args={...})``), the two
places a client of vLLM's API can set per request. Read at every plan, since a method may
set a mark at any step."""

from __future__ import annotations

COMPACTED = "kv_compacted"  # its KV was rewritten by token eviction: never publish it (compaction.py)
LOSSLESS = "kv_lossless"  # load nothing a lossy tier form gave back (docs/codecs.md)


def marked(request, key: str) -> bool:
    for params in (getattr(request, "kv_transfer_params", None),
                   getattr(getattr(request, "sampling_params", None), "extra_args", None)):
        if isinstance(params, dict) and params.get(key):
            return True
    return False
