"""Fixtures shared by the unit tests that need a real local pool."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture
def sockdir():
    # Short path: Unix socket paths are limited to ~107 bytes.
    d = tempfile.mkdtemp(prefix="asu-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pool(sockdir):
    from tests.unit.test_local_pool import Pool  # zmq: only tests that use a pool need it

    p = Pool(os.path.join(sockdir, "pool.sock")).start()
    yield p
    p.stop()
