"""The store helper process: one store client (Mooncake, memcache) serving its owner's calls.

Started by helper.py as ``python -m ascend_store.backends.helper_main SOCK_FD MEM_FD SIZE
OWNER_PID SPEC``: it maps the owner's staging buffer (MEM_FD, shared memory), registers it
with the store, and answers requests on SOCK_FD one at a time. A binding may hold this
process's GIL as long as it likes: the owner's threads keep running, and a call that
misses its deadline gets this process killed. It dies with its owner (parent-death
signal), and exits when the owner closes the socket.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import mmap
import os
import signal
import socket
import sys

import numpy as np

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.helper_protocol import ClientReset, Reply, Request, StoreClient, recv_blocking

PR_SET_PDEATHSIG = 1


def _die_with(owner: int) -> None:
    """SIGKILL when the owner's spawning thread exits (helper.py spawns from a thread that
    lives as long as the owner); exit at once if the owner is already gone."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != owner:
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the owner's to handle


def _client(spec: dict) -> StoreClient:
    module, _, name = spec["client"].partition(":")
    return getattr(importlib.import_module(module), name)(spec["config"], spec["role"], spec["timeout_s"])


class Server:
    """Answers one request at a time: the client's return values, or its failure."""

    def __init__(self, client: StoreClient, base: int, size: int):
        self.client, self.base, self.size = client, base, size

    def serve(self, req: Request) -> Reply:
        try:
            return Reply(req.id, np.asarray(self._run(req), dtype=np.int64))
        except ClientReset as exc:
            return Reply(req.id, error=str(exc), reset=True)
        except BackendUnavailable as exc:
            return Reply(req.id, error=str(exc))
        except Exception as exc:  # the bindings raise assorted errors: start over with a new client
            return Reply(req.id, error=f"store {req.op} failed: {exc!r}", reset=True)

    def _run(self, req: Request) -> list[int]:
        c = self.client
        if req.op == "setup":
            c.set_up(self.base, self.size)
            return []
        if req.op == "close":
            c.close()
            return []
        if req.op == "ping":  # the owner's call set the client up first: nothing more to do
            return []
        if req.op in ("exists", "remove"):
            return getattr(c, req.op)(req.keys)
        offs, sizes = req.offsets, req.sizes
        if len(offs) != len(req.keys) or len(sizes) != len(req.keys) or (
                len(offs) and (offs.min() < 0 or sizes.min() < 0 or (offs + sizes).max() > self.size)):
            raise ValueError(f"{req.op}: slots outside the staging buffer")
        return getattr(c, req.op)(req.keys, (offs + self.base).tolist(), sizes.tolist())


def main(argv: list[str]) -> None:
    sock_fd, mem_fd, size, owner = (int(a) for a in argv[:4])
    _die_with(owner)
    spec = json.loads(argv[4])
    mem = mmap.mmap(mem_fd, size)
    os.close(mem_fd)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    server = Server(_client(spec), base, size)
    sock = socket.socket(fileno=sock_fd)
    while (data := recv_blocking(sock)) is not None:
        req = Request.unpack(data)
        sock.sendall(server.serve(req).pack())
        if req.op == "close":
            break


if __name__ == "__main__":
    main(sys.argv[1:])
