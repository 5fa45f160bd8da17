"""Can a full CUDA graph wait for a pool load layer by layer? (GPU, torch only.)

Under vLLM's full graphs a full pool hit's whole load must land before the graph's replay
(docs/architecture.md), so the one-token forward runs after the last byte: about 6 ms at
7B 32K on an H100 (docs/benchmarks.md, its 7B 32K trace). A wait captured inside the graph
on an event recorded outside it (``torch.cuda.Event(external=True)``: an event-wait node)
would let layer i's part of the graph wait for layer i's copy only. This probe checks it
with a synthetic forward (per layer: a GEMV over the layer's weights, then a read of that
layer's loaded bytes), per step:

  load      the copies alone: every layer's bytes from pinned host memory, one stream
  forward   the graph alone (nothing to wait for)
  serial    the copies, a wait for the last, then the graph without waits (what a full
            graph step does today)
  layered   the copies, then the graph captured with one wait per layer
  control   the copies, then the graph without waits and no wait before it: it must read
            stale bytes in some layers, or this probe could not see a missing wait
  layered, upload after    as layered, with a small host-to-device copy on the compute stream
            between the copies and the graph (vLLM uploads a step's inputs before its graph
            runs): copies of one direction share the copy engines' queues whatever their
            streams, so if the upload waits behind the layers' copies the graph cannot start
            before the last layer has landed
  layered, upload first    the upload queued before the copies (a load that starts after the
            step's inputs are uploaded)

Each step writes a new marker at both ends of every layer's host bytes; a layer's compute
reads them back, so "stale" counts layers whose forward read the previous step's bytes.

It also finds which record of an event a graph's wait node waits for when the event is
recorded again after the graph's launch but before the node runs (``resolution``). With
vLLM's asynchronous scheduling the next step's loads are queued while this step's graph
may still wait to run; if the node took the newer record, a load stream that follows the
compute stream would deadlock with the graph.

    python benchmarks/graph_waits.py [--layers 28] [--layer-mb 67] [--weight-mb 512]
                                     [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

MARK = 4096  # marker elements at each end of a layer's bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--layer-mb", type=int, default=67, help="KV bytes per layer (7B at 32K: 67)")
    ap.add_argument("--weight-mb", type=int, default=512, help="weights a layer's GEMV reads")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_waits.py needs a CUDA device")
    layers, elems = args.layers, (args.layer_mb << 20) // 2
    side = math.isqrt((args.weight_mb << 20) // 2)
    src = [torch.zeros(elems, dtype=torch.bfloat16, pin_memory=True) for _ in range(layers)]
    dst = [torch.zeros(elems, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    weights = [torch.randn(side, side, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    x = torch.randn(side, dtype=torch.bfloat16, device="cuda")
    seen = torch.zeros(layers, dtype=torch.float32, device="cuda")
    events = [torch.cuda.Event(external=True) for _ in range(layers)]
    load = torch.cuda.Stream()
    for ev in events:  # an event must exist before a capture waits on it
        ev.record(load)
    torch.cuda.synchronize()

    def layer(i: int) -> None:
        h = weights[i] @ x
        marks = dst[i][:MARK].float().sum() + dst[i][-MARK:].float().sum()
        seen[i].copy_(marks + 0.0 * h[0].float())

    def capture(waits: bool) -> torch.cuda.CUDAGraph:
        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):  # warm-up outside the capture
            for i in range(layers):
                layer(i)
        torch.cuda.current_stream().wait_stream(side_stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(layers):
                if waits:
                    torch.cuda.current_stream().wait_event(events[i])
                layer(i)
        return graph

    plain, waiting = capture(False), capture(True)
    step = [0]

    def mark() -> torch.Tensor:
        """New markers in the host bytes; what each layer must read once its copy landed."""
        step[0] += 1
        want = [float((step[0] * 7 + i) % 61 + 1) for i in range(layers)]
        for i, v in enumerate(want):
            src[i][:MARK].fill_(v)
            src[i][-MARK:].fill_(v)
        return torch.tensor(want) * (2 * MARK)

    def copies() -> None:
        with torch.cuda.stream(load):
            for i in range(layers):
                dst[i].copy_(src[i], non_blocking=True)
                events[i].record(load)

    def serial() -> None:
        copies()
        torch.cuda.current_stream().wait_event(events[-1])
        plain.replay()

    def layered() -> None:
        copies()
        waiting.replay()

    def control() -> None:
        copies()
        plain.replay()

    inputs = torch.zeros(64 << 10, dtype=torch.int32, pin_memory=True)  # ~ a step's input tensors
    inputs_dev = torch.zeros_like(inputs, device="cuda")

    def upload_after() -> None:
        copies()
        inputs_dev.copy_(inputs, non_blocking=True)
        waiting.replay()

    def upload_first() -> None:
        inputs_dev.copy_(inputs, non_blocking=True)
        copies()
        waiting.replay()

    got: dict = {"resolution": resolution()}
    cases = {"load": copies, "forward": plain.replay, "serial": serial, "layered": layered,
             "control": control, "layered, upload after": upload_after,
             "layered, upload first": upload_first}
    for name, run in cases.items():
        times, stale = [], []
        for rep in range(args.reps + 1):  # the first is a warm-up
            want = mark()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            if rep:
                times.append(ms)
                if name not in ("load", "forward"):
                    stale.append(int((seen.cpu() != want).sum()))
        got[name] = {"ms": statistics.median(times), "all_ms": times, "stale_layers": stale}
    gb = layers * elems * 2 / 1e9
    got["load_gbs"] = gb / got["load"]["ms"] * 1e3
    print(f"{torch.cuda.get_device_name()}: {layers} layers, {gb:.2f} GB loaded, "
          f"{got['load_gbs']:.1f} GB/s")
    print(f"  a graph's wait node waits for the event's record as of the graph's {got['resolution']}")
    for name in cases:
        r = got[name]
        print(f"  {name:<22} {r['ms']:7.2f} ms   stale layers per step: {r['stale_layers'] or '-'}")
    hidden = got["serial"]["ms"] - got["layered"]["ms"]
    print(f"  layered saves {hidden:.2f} ms of the forward's {got['forward']['ms']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), **got}, f, indent=1)


def resolution() -> str:
    """Record an event (done at once), queue a long sleep then the graph that waits on it,
    then, behind a longer sleep on another stream, set a flag and record the event again.
    A node that takes the record as of the launch runs after the first sleep and reads the
    flag unset; one that takes it as of its own execution waits for the second record."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    stop.record()
    stop.synchronize()
    ms = 10**7 / start.elapsed_time(stop)  # the sleep's cycles per ms
    flag = torch.zeros(1, device="cuda")
    got = torch.zeros(1, device="cuda")
    ev = torch.cuda.Event(external=True)
    other = torch.cuda.Stream()
    ev.record(other)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.current_stream().wait_event(ev)
        got.copy_(flag)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(50 * ms))
    graph.replay()
    with torch.cuda.stream(other):
        torch.cuda._sleep(int(150 * ms))
        flag.fill_(1.0)
        ev.record(other)
    torch.cuda.synchronize()
    return "launch" if got.item() == 0.0 else "execution"


if __name__ == "__main__":
    main()
