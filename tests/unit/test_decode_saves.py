"""Decode-time saves: the chain over an answer must be the one the next turn's prompt hashes to."""

from __future__ import annotations

from types import SimpleNamespace

from ascend_store.common.keys import chunk_hashes, request_extras
from ascend_store.ops.stats import IntervalCounters
from ascend_store.scheduler.decode_saves import DecodeChain

CHUNK = 32


def _request(tokens: list[int], prompt_len: int, **over):
    fields = dict(prompt_token_ids=tokens[:prompt_len], all_token_ids=tokens, lora_request=None,
                  cache_salt="tenant-a", mm_features=[], prompt_embeds=None)
    fields.update(over)
    return SimpleNamespace(**fields)


def test_chain_over_the_answer_is_the_next_turns_prompt_chain():
    counters = IntervalCounters()
    chain = DecodeChain(CHUNK, counters)
    turn = list(range(1000, 1000 + 100))  # a 40-token prompt, then 60 generated tokens
    req = _request(turn, 40)
    extras = request_extras(req, CHUNK)  # the salt seeds the chain: it must carry over
    hashes = chunk_hashes(req.prompt_token_ids, CHUNK, extras)
    assert len(hashes) == 1

    same = chain.extend(req, hashes, extras, 63)  # chunk 1 not computed yet
    assert same is hashes
    hashes = chain.extend(req, hashes, extras, 99)  # 96 tokens in full chunks
    next_turn = _request(turn + [7, 8, 9] * 10, 130)
    expect = chunk_hashes(next_turn.prompt_token_ids, CHUNK, request_extras(next_turn, CHUNK))
    assert hashes == expect[:3]
    assert counters.total["decode_chunks"] == 2

    # The salt changes every chunk: a chain continued without the request's extras fails above.
    assert hashes[1] != chunk_hashes(next_turn.prompt_token_ids, CHUNK)[1]


def test_prompt_embeddings_keep_their_prompt_chain():
    chain = DecodeChain(CHUNK, IntervalCounters())
    req = _request(list(range(100)), 40, prompt_embeds=object())
    hashes = ["a"]
    assert chain.extend(req, hashes, None, 99) is hashes
