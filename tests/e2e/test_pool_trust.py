"""Pool trust against a real engine: a pool another user squats is refused, a pool whose
arena cannot be backed never starts, and either way every request completes by
recompute with the tokens of a run without the pool. Each test starts one engine
(about 40 s on the 2-core CI machine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from ascend_store.backends.local.client import LocalBackend
from ascend_store.backends.local.launcher import ping
from ascend_store.common.config import LocalPoolConfig
from tests.e2e.conftest import REPO, assert_same_outputs, kv_config, prompts, run_engine

_CAN = os.getuid() == 0 and shutil.which("setpriv") and shutil.which("unshare")
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not _CAN, reason="needs root, setpriv and unshare "
                                                  "(to act as another user and mount a tmpfs)")]
OTHER_UID = 65534  # nobody


@pytest.fixture
def squatter():
    """Another local user got to this engine's socket path first (the default path's
    directory in a sticky, world-writable /tmp-like directory) and runs a pool of its own."""
    base = tempfile.mkdtemp(prefix="asq-", dir="/tmp")
    os.chmod(base, 0o1777)
    sock = os.path.join(base, f"ascend-store-{os.getuid()}", "pool.sock")
    proc = subprocess.Popen(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", sys.executable, "-m",
         "ascend_store.ops.cli", "pool", "serve", "--socket", sock, "--capacity", "16MiB"],
        env={**os.environ, "PYTHONPATH": REPO}, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not ping(sock):
            assert proc.poll() is None and time.monotonic() < deadline, "the squatter's pool did not start"
            time.sleep(0.05)
        assert os.stat(sock).st_uid == OTHER_UID
        yield sock
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def test_engine_refuses_a_pool_squatted_by_another_user(tmp_path, model, baseline, squatter):
    r = run_engine(tmp_path, model, [prompts(), prompts()], kv_config(squatter))  # start: auto
    for out in r["rounds"]:
        assert_same_outputs(out, baseline)
        assert all(o["num_cached_tokens"] == 0 for o in out)
    assert r["log"].count("refusing the local pool") == 1, r["log"][-3000:]
    assert f"is owned by uid {OTHER_UID}, not by this user" in r["log"]
    assert r["scheduler"]["lookup_errors"] > 0
    # The squatter's pool never saw a key or an object of ours (asked trusting its uid on purpose).
    spy = LocalBackend(LocalPoolConfig(socket=squatter, start="never", trusted_uid=OTHER_UID),
                       timeout_s=2.0, map_arena=False)
    try:
        st = spy.stats()
    finally:
        spy.close()
    assert sum(st["key_queries"].values()) == 0 and st["objects"] == 0 and st["reserved"] == 0


def test_engine_whose_pool_arena_cannot_be_backed_is_refused_at_start(tmp_path, model):
    """/dev/shm (64 MiB) is too small for the 256 MiB pool, so the arena would go beside the
    socket, on a 2 MiB tmpfs. The engine's capacity check sees that before the model loads
    and refuses, naming the JSON key, once (the pool's own start failure there, a clear error
    rather than a SIGBUS on the first write, is tests/unit/test_pool_trust.py's)."""
    small = tmp_path / "small"
    small.mkdir(mode=0o700)
    mounts = (f"mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && "
              f"mount -t tmpfs -o size=2m,mode=700 tmpfs {small} && exec \"$@\"")
    with pytest.raises(AssertionError) as refused:
        run_engine(tmp_path, model, [prompts()], kv_config(str(small / "pool.sock")),
                   wrap=["unshare", "-m", "sh", "-c", mounts, "sh"])
    log = str(refused.value)
    assert log.count("local.capacity: 0.2 GiB does not fit") == 1, log
    assert "Loading weights" not in log and "could not start a pool" not in log
