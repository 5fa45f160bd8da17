"""Does a load running beside the forward slow the forward's host loop? (GPU, vLLM-free)

In H200 timelines of a 7B 4K hit the forward's layers took ~4 ms more host time with
our copies running beside them than LMCache's, whose copies are done before its forward
starts, though our hooks inside took 0.3 ms. This times a host-bound, forward-like loop
(28 "layers" of small eager ops on the compute stream, as vLLM runs a full hit's
one-token step with ``enforce_eager``) while, in turn:

  idle       nothing else
  dma        pinned host -> device copies on a side stream (the load's DMAs)
  dma+wait   the same, and the compute stream first waits for them (as a layer waits for
             its load: the forward's kernels queue up behind the wait)
  kernel     a device -> device copy kernel on a side stream (the load's scatter)

Host ms of the loop (launches only, no synchronize inside), median of ``--reps``; the
ratio to idle says whether the concurrent work slows the host.

    python benchmarks/dma_host_contention.py [--mib 256] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def forward_like(x: torch.Tensor, w: torch.Tensor, layers: int = 28) -> torch.Tensor:
    for _ in range(layers):  # ~12 launches a layer, like a decode layer's eager ops
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        h = (h.to(x.dtype) @ w).relu()
        x = x + h[:, :x.shape[1]] * 0.5
        x = x.contiguous()
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="bytes each side copy moves")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = args.mib << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    other = torch.empty(n, dtype=torch.uint8, device=dev)
    x = torch.randn(16, 4096, dtype=torch.bfloat16, device=dev)
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev) * 0.01
    side = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    for _ in range(3):
        forward_like(x, w)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    link = n / (time.perf_counter() - t0) / 1e9

    def run(mode: str) -> float:
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            if mode in ("dma", "dma+wait"):
                for _ in range(4):  # ~20 ms of link: longer than the loop
                    dst.copy_(host, non_blocking=True)
            elif mode == "kernel":
                for _ in range(40):
                    other.copy_(dst)
            done = torch.cuda.Event()
            done.record(side)
        if mode == "dma+wait":
            compute.wait_event(done)
        t = time.perf_counter()
        forward_like(x, w)
        t = time.perf_counter() - t
        torch.cuda.synchronize()
        return t * 1e3

    modes = ("idle", "dma", "dma+wait", "kernel")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.reps):  # interleaved, so drift in the host's speed hits all alike
        for m in modes:
            times[m].append(run(m))
    base = statistics.median(times["idle"])
    print(f"{torch.cuda.get_device_name()}; pinned copy {link:.1f} GB/s; host ms of a 28-layer eager loop")
    for m in modes:
        med = statistics.median(times[m])
        print(f"  {m:>9}: median {med:6.2f}  p90 {sorted(times[m])[int(0.9 * len(times[m]))]:6.2f}  "
              f"x{med / base:.2f} of idle")


if __name__ == "__main__":
    main()
