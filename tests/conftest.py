"""Suite-wide checks."""

from __future__ import annotations

import os
import time

import pytest

from ascend_store.backends.local import arena


def _dead_arenas() -> set[str]:
    """Arenas in /dev/shm whose pool is gone (their lock is free; a live pool, of this run
    or of another one on the machine, holds it)."""
    import fcntl

    out = set()
    for name in os.listdir(arena.SHM):
        path = os.path.join(arena.SHM, name)
        if not arena.is_arena(path):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            out.add(path)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    return out


@pytest.fixture(scope="session", autouse=True)
def dev_shm_left_as_found():
    """Runs after the last test: no arena a pool of this run created may be left in
    /dev/shm (a leaked arena holds its memory until it is removed or the host reboots).
    Pools that outlive their engine by up to one reap interval get a few seconds to
    remove theirs."""
    if not os.path.isdir(arena.SHM):
        yield
        return
    before = _dead_arenas() | {os.path.join(arena.SHM, n) for n in os.listdir(arena.SHM)}
    yield
    deadline = time.monotonic() + 10
    while (left := _dead_arenas() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the suite left arenas of dead pools in /dev/shm: {sorted(left)}"
