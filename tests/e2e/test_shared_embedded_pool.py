"""An embedded pool outlives the engine that started it while another engine uses it.

Engine 1 starts the embedded pool (``start: auto``), engine 2 joins it on the same socket,
both compute and save the same prompts. Engine 1 then leaves (SIGKILL, or a normal exit),
and engine 2, a few seconds later, loads every full block of its next round from the pool
with the tokens of a run without it. Once engine 2 has exited too, the pool exits, removing
its socket and its arena. The two engines run at once: short prompts, few rounds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ascend_store.backends.local.launcher import ping
from tests.e2e.conftest import BLOCK, ENGINE_TIMEOUT_S, HERE, REPO, assert_same_outputs, kv_config, prompts
from tests.unit.test_local_pool import _running

pytestmark = pytest.mark.e2e
IDLE_EXIT_S = 1.0


def _start(tmp_path, name: str, model: str, rounds, kv: dict, **job) -> subprocess.Popen:
    path = tmp_path / f"job-{name}.json"
    path.write_text(json.dumps({"model": model, "kv_config": kv, "rounds": rounds, "block_size": BLOCK,
                                **job}))
    # A session of its own: killing it takes its between-round shell along (not the pool,
    # which the launcher starts in a session of its own too).
    with open(tmp_path / f"{name}.log", "w") as log:
        return subprocess.Popen([sys.executable, os.path.join(HERE, "runner.py"), str(path)],
                                env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                                stderr=log, text=True, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def _wait(cond, what: str, procs=(), timeout_s: float = ENGINE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        for p in procs:
            assert p.poll() is None, f"{what}: an engine exited with {p.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=ENGINE_TIMEOUT_S)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine failed ({proc.returncode})"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("leaves", ["sigkill", "exit"])
def test_the_pool_outlives_its_starter_and_goes_after_the_last_engine(tmp_path, model, baseline, leaves):
    socket = str(tmp_path / "pool" / "pool.sock")
    kv = kv_config(socket, local={"idle_exit_s": IDLE_EXIT_S})  # start: auto
    want = baseline[:2]
    flag = lambda name: str(tmp_path / name)  # noqa: E731
    # A shell command for an engine: say it got there, then wait for the test's go-ahead.
    wait_for = lambda name: (f"touch {flag(name + '.ready')} && "  # noqa: E731
                             f"while [ ! -e {flag(name)} ]; do sleep 0.1; done")
    one = _start(tmp_path, "one", model, [prompts()[:2]], kv, after=wait_for("one-go"))
    try:
        _wait(lambda: ping(socket), "engine 1 to start the pool", [one])
        pool = ping(socket)
        two = _start(tmp_path, "two", model, [prompts()[:2]] * 2, kv, between=[wait_for("two-go")])
        try:
            _wait(lambda: os.path.exists(flag("one-go.ready")) and os.path.exists(flag("two-go.ready")),
                  "both engines' first round", [one, two])
            if leaves == "sigkill":
                _kill(one)
            else:
                open(flag("one-go"), "w").close()
                first = _result(one)
                assert_same_outputs(first["rounds"][0], want)
            time.sleep(2)  # the pool has seen engine 1 go
            assert ping(socket) and ping(socket)["epoch"] == pool["epoch"], "the pool went with engine 1"
            open(flag("two-go"), "w").close()
            r = _result(two)
        finally:
            _kill(two)
    finally:
        _kill(one)
    again = r["rounds"][1]
    assert [o["num_cached_tokens"] for o in again] == [96, 128]  # every full block from the pool
    assert_same_outputs(again, want)
    assert r["per_round"][1]["worker"]["failed_blocks"] == 0
    # The last engine is gone: the pool exits on its own, removing its socket and arena.
    _wait(lambda: not _running(pool["pid"]), "the pool to exit", timeout_s=IDLE_EXIT_S + 15)
    assert not os.path.exists(socket) and not os.path.exists(pool["arena"])
