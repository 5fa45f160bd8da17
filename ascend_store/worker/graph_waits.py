"""Per-layer waits inside vLLM's full CUDA graphs (dense models on CUDA).

A full graph's replay runs no Python, so a full pool hit's step (``StepMetadata.full_graph``)
used to make the compute stream wait for its whole load before the replay, and the graph's
forward ran after the last byte (about 6 ms at 7B 32K on an H100). Here each attention
layer's part of the graph waits for that layer's copies only:

- while vLLM captures a full graph, ``wait_for_layer_load`` makes the capturing stream
  wait on the layer's persistent event (``torch.cuda.Event(external=True)``: the graph
  gets an event-wait node);
- a marked step's loads record each layer's event on the load stream once every part of
  that layer is queued (``GraphStep``).

A wait node takes the event's record as of the graph's launch (benchmarks/graph_waits.py
checks it), so a later step's records never hold back a graph already launched; in a step
without loads the last records are long done and the waits cost nothing. Only when every
layer's wait was captured equally often (each full graph waits for every layer) does a step
rely on them; otherwise the whole load lands before the forward, as before.
"""

from __future__ import annotations

from collections import Counter

from ascend_store.device.platform import Device


class GraphWaits:
    def __init__(self, dev: Device, parts: dict[str, list[str]]):
        self.dev = dev
        self.parts = parts  # vLLM layer -> its parts in the loader's order
        self.of_part = {p: name for name, ps in parts.items() for p in ps}
        self.events = {name: dev.graph_event() for name in parts}
        self.captured: Counter[str] = Counter()  # waits captured per layer

    @classmethod
    def of(cls, dev: Device, parts: dict[str, list[str]]) -> GraphWaits | None:
        """None where the runtime captures no event waits (CPU; NPU not yet)."""
        return cls(dev, parts) if dev.type == "cuda" else None

    def capturing(self) -> bool:
        return self.dev.capturing()

    @property
    def armed(self) -> bool:
        """Every layer's wait is in every captured full graph."""
        counts = set(self.captured[name] for name in self.events)
        return len(counts) == 1 and counts != {0}

    def wait(self, layer: str) -> None:
        """In a capture: the graph's node for this layer. Else (vLLM ran a marked step
        eagerly or piecewise after all): the compute stream waits here."""
        event = self.events.get(layer)  # None: a layer this worker holds no KV cache of
        if event is not None:
            self.captured[layer] += self.capturing()
            self.dev.wait(event)

    def step(self) -> GraphStep:
        return GraphStep(self)


class GraphStep:
    """One marked step's records: a layer's event once all its parts' copies are queued.
    A layer with nothing to load this step keeps its last record (done long ago)."""

    def __init__(self, waits: GraphWaits):
        self.waits = waits
        self.left = {name: len(ps) for name, ps in waits.parts.items()}

    def queued(self, parts: list[str], stream) -> None:
        """``parts``' copies are queued, and end on ``stream`` (the load stream, where
        ``DevicePath.queue_batch`` records their ``done`` too)."""
        for p in parts:
            name = self.waits.of_part.get(p)
            if name is None:
                continue
            self.left[name] -= 1
            if self.left[name] == 0:
                self.waits.events[name].record(stream)

    def close(self, stream) -> None:
        """Every batch is queued: a layer only some of whose parts load (a slice's object
        missing) is recorded after them all."""
        for name, left in self.left.items():
            if 0 < left < len(self.waits.parts[name]):
                self.waits.events[name].record(stream)
                self.left[name] = 0
