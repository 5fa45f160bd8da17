"""A subscriber of vLLM's KV events, decoded as its consumers do (msgspec over ZMQ SUB)."""

from __future__ import annotations

import threading

import msgspec
import zmq


class KVEventSubscriber(threading.Thread):
    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        from vllm.distributed.kv_events import KVEventBatch

        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.events: list = []
        self.running = True

    def run(self) -> None:
        while self.running:
            if self.sock.poll(100):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events += self.decoder.decode(payload).events

    def of(self, kind: str, medium: str = "CPU") -> list:
        """The events of one kind (``BlockStored``, ``BlockRemoved``) and medium so far."""
        return [ev for ev in list(self.events) if type(ev).__name__ == kind and ev.medium == medium]

    def hashes(self, kind: str, medium: str = "CPU") -> list:
        return [h for ev in self.of(kind, medium) for h in ev.block_hashes]
