"""Decode-time saves (``save_decode_cache``, dense models; docs/config.md).

The next turn of a conversation prompts with this prompt, this answer and more, so the
scheduler continues a request's chunk chain over its generated tokens: the answer's full
chunks are then saved by the usual save plan, under the keys the next turn's prompt hashes
to, and load there in any engine (tests/e2e/test_pd_serving.py). A turn's last partial
chunk is never saved.
"""

from __future__ import annotations

from ascend_store.common.keys import KeyExtras, chunk_hashes
from ascend_store.ops.stats import IntervalCounters


class DecodeChain:
    def __init__(self, chunk_tokens: int, counters: IntervalCounters):
        self.chunk = chunk_tokens
        self.counters = counters

    def extend(self, request, hashes: list[str], extras: KeyExtras | None,
               computed_after_step: int) -> list[str]:
        """The chain over every full chunk of ``request``'s tokens whose KV is computed
        after this step; ``hashes`` (the chain so far) until a chunk boundary is crossed."""
        if getattr(request, "prompt_embeds", None) is not None:
            # Its chunks are named by their embedding rows (keys.request_extras), which
            # the answer's token ids cannot continue.
            return hashes
        tokens = request.all_token_ids
        n = min(computed_after_step, len(tokens)) // self.chunk
        if n <= len(hashes):
            return hashes
        self.counters["decode_chunks"] += n - len(hashes)
        return chunk_hashes(tokens[:n * self.chunk], self.chunk, extras)
