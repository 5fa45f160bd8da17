"""Damage a running local pool on purpose, from outside the engine (test helper).

    python tests/e2e/pool_tamper.py flip SOCKET SET:INDEX     # flip a payload byte (first layer)
    python tests/e2e/pool_tamper.py swap SOCKET SET:INDEX     # swap the first two layers' parts
    python tests/e2e/pool_tamper.py remove SOCKET SET:INDEX   # delete the prompt's objects
    (flip and remove take an optional last argument: the chunk objects to touch by their
    KV cache group, e.g. g0)
    python tests/e2e/pool_tamper.py kill SOCKET               # SIGKILL the pool
    python tests/e2e/pool_tamper.py restart SOCKET            # SIGKILL it, start a new one
SET is a prompt set of tests/e2e/conftest.py (PROMPT_SETS), INDEX a prompt in it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ascend_store.backends.local.arena import gc_arenas
from ascend_store.backends.local.client import LocalBackend
from ascend_store.backends.local.clients import alive
from ascend_store.backends.local.launcher import ping
from ascend_store.common.config import LocalPoolConfig
from ascend_store.common.keys import chunk_hashes
from ascend_store.common.transfer import HEADER, HEADER_BYTES
from tests.e2e.conftest import BLOCK, CHUNK_OF_SET, PROMPT_SETS


def main(op: str, socket: str, prompt: str = "basic:0", groups: str = "") -> None:
    client = LocalBackend(LocalPoolConfig(socket=socket, start="never"), timeout_s=2.0)
    if op in ("kill", "restart"):
        old = client.stats()
        os.kill(old["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(old["pid"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        gc_arenas()  # what an operator runs after a SIGKILL: the dead pool's arena goes
        if op == "restart":  # a new pool on the same socket, living as long as the engine
            subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli",
                              "pool", "serve", "--socket", socket,
                              "--capacity", str(old["capacity"]), "--parent-pid", os.environ["ENGINE_PID"]],
                             start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 20
            while not ((hello := ping(socket)) and hello["epoch"] != old["epoch"]):
                assert time.monotonic() < deadline, "the new pool did not start"
                time.sleep(0.05)
        return
    name, index = prompt.split(":")
    hashes = set(chunk_hashes(PROMPT_SETS[name]()[int(index)], CHUNK_OF_SET.get(name, BLOCK)))
    wanted = set(groups.split(",")) if groups else None
    keys = sorted(k for k, _, ready, _ in client.list() if ready and k.rsplit("/", 1)[1] in hashes
                  and (wanted is None or k.split("/")[1] in wanted))
    if op == "remove":  # idempotent: nothing stored is fine
        print(f"remove: {client.remove(keys)}")
        return
    assert keys, "no objects of that prompt in the pool"
    _, view = client.buffer()
    slots = dict(zip(keys, client.lease(keys)))
    if op == "flip":
        for s in slots.values():
            view[s.offset + HEADER_BYTES + 7] ^= 0x40
    elif op == "swap":  # a chunk object's layers have equal parts here (raw codec, one layout)
        for s in slots.values():  # the first part's length is in its header
            part = HEADER_BYTES + HEADER.unpack(bytes(view[s.offset:s.offset + HEADER_BYTES]))[4]
            a, b = s.offset, s.offset + part
            tmp = bytes(view[a:a + part])
            view[a:a + part] = view[b:b + part]
            view[b:b + part] = tmp
    else:
        raise SystemExit(f"unknown op {op}")
    client.release(keys)
    print(f"{op}: {len(keys)} objects")


if __name__ == "__main__":
    main(*sys.argv[1:])
