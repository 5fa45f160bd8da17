"""What slows a forward while the host path loads on the other core: the GIL or memory?

A forward-like loop (8 layers of small matmuls over 84 MB of fp32 weights, as the
model of benchmarks/async_load.py, plus small Python-dispatched ops) runs on
core 0 and reports its median step time while a second thread on core 1 runs, in turn:
nothing; host_loads.load_layer over 8 layers of a 3,584-token hit (ours); one plain copy
of 119 MiB (memory traffic without GIL handoffs); a pure-Python loop (GIL only). Needs
two cores; vLLM-free.

    python benchmarks/host_load_contention.py
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ascend_store.common.codecs import RAW  # noqa: E402
from ascend_store.common.transfer import HEADER_BYTES, HEADER_RECORD, LayerLayout, object_bytes, write_object  # noqa: E402
from ascend_store.device.segments import StepPages  # noqa: E402
from ascend_store.worker import host_loads  # noqa: E402

BLOCKS, PAGES, OBJECTS, LAYERS = 130, 8, 14, 8  # 14 chunk objects of 8 blocks of 32 tokens


def main() -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    src = LayerLayout(torch.randn(BLOCKS, 8, 32, 128), 0)  # vLLM CPU's [blocks, heads, block, 2 * 64]
    size = object_bytes(src, PAGES, RAW)
    arena = torch.zeros(64 + OBJECTS * LAYERS * size, dtype=torch.uint8)
    starts = np.arange(OBJECTS * LAYERS, dtype=np.int64) * size + 64
    for k, at in enumerate(starts.tolist()):
        blocks = list(range(1 + k % OBJECTS * PAGES, 1 + (k % OBJECTS + 1) * PAGES))
        write_object(arena[at:at + size], src, blocks, f"k{k}", True, RAW)
    dsts = [LayerLayout(torch.zeros_like(src.tensor), 0) for _ in range(LAYERS)]
    host, words, scratch = arena.numpy(), host_loads.words_of(arena), host_loads.Scratch()
    gate = host_loads.WriteGate()
    pages = StepPages.of([list(range(1 + o * PAGES, 1 + (o + 1) * PAGES)) for o in range(OBJECTS)],
                         [0] * OBJECTS, [PAGES] * OBJECTS)
    live = np.ones(OBJECTS, dtype=bool)

    def load() -> None:
        for layer in range(LAYERS):
            st = starts[layer * OBJECTS:(layer + 1) * OBJECTS]
            headers = np.stack([host[s:s + HEADER_BYTES].view(HEADER_RECORD)[0] for s in st.tolist()])
            faults = host_loads.load_layer(words, host, dsts[layer], pages, st, headers, live, True, scratch,
                                           gate)
            assert not len(faults.entries)

    weights = [[torch.randn(512, 1536), torch.randn(512, 512), torch.randn(512, 1024), torch.randn(512, 1024),
                torch.randn(1024, 512)] for _ in range(LAYERS)]
    x = torch.randn(1, 512)

    def step() -> None:
        h = x
        for w in weights:
            for _ in range(6):
                h = h * 1.0 + 0.0
            h @ w[0], h @ w[1]
            h = (torch.nn.functional.silu(h @ w[2]) * (h @ w[3])) @ w[4]

    big = torch.empty(119 << 20, dtype=torch.uint8)
    out = torch.empty_like(big)

    def spin() -> None:
        for _ in range(10000):
            pass

    for label, work in (("nothing", None), ("host_loads.load_layer x8", load),
                        ("one 119 MiB copy (memory only)", lambda: out.copy_(big)),
                        ("a Python loop (GIL only)", spin)):
        stop = False

        def run(work=work) -> None:
            os.sched_setaffinity(0, {1})
            while not stop:
                work()

        t = threading.Thread(target=run) if work else None
        if t:
            t.start()
        time.sleep(0.05)
        times = []
        for _ in range(40):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        stop = True
        if t:
            t.join()
        print(f"{label:32s} forward step median {np.median(times) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
