"""A stand-in for ``memcache_hybrid`` (Ascend MemFabric's Python client), which needs
Ascend drivers to move data. It follows the client API our backend uses (LocalConfig,
DistributedObjectStore.setup/init/register_buffer/batch_is_exist/batch_put_from/
batch_get_into/remove/close) and keeps objects as files in the directory named by
``meta_service_url`` (``file:///dir``), so two processes share them. A ``capacity`` file
in that directory bounds the bytes stored (oldest objects are evicted first).

This is a MOCK of the data plane: it shows our backend drives the API correctly, not
that memcache itself behaves like this on hardware.
"""

from __future__ import annotations

import ctypes
import os


class LocalConfig:
    def __init__(self):
        self.meta_service_url = ""
        self.config_store_url = ""
        self.protocol = "tcp"
        self.dram_size = 0


class DistributedObjectStore:
    def setup(self, config: LocalConfig) -> int:
        if not config.meta_service_url.startswith("file://"):
            return -1
        self.dir = config.meta_service_url[len("file://"):]
        return 0 if os.path.isdir(self.dir) else -900

    def init(self, device_id: int) -> int:
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        self.buf = (ptr, size)
        return 0

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key.replace("/", "%"))

    def _alive(self) -> bool:
        return os.path.isdir(self.dir)

    def batch_is_exist(self, keys):
        if not self._alive():
            return [-900] * len(keys)
        return [1 if os.path.exists(self._path(k)) else 0 for k in keys]

    def batch_put_from(self, keys, ptrs, sizes, direct=3):
        if not self._alive():
            return [-900] * len(keys)
        out = []
        for k, p, n in zip(keys, ptrs, sizes):
            if os.path.exists(self._path(k)):
                out.append(-2)  # existing objects keep their value
                continue
            self._make_room(n)
            tmp = self._path(k) + ".tmp"
            with open(tmp, "wb") as f:
                f.write(ctypes.string_at(p, n))
            os.replace(tmp, self._path(k))
            out.append(0)
        return out

    def batch_get_into(self, keys, ptrs, sizes, direct=2):
        if not self._alive():
            return [-900] * len(keys)
        out = []
        for k, p, n in zip(keys, ptrs, sizes):
            try:
                data = open(self._path(k), "rb").read()
            except FileNotFoundError:
                out.append(-704)
                continue
            if len(data) > n:
                out.append(-600)
                continue
            ctypes.memmove(p, data, len(data))
            out.append(len(data))
        return out

    def remove(self, key: str) -> int:
        try:
            os.unlink(self._path(key))
            return 0
        except FileNotFoundError:
            return -704

    def close(self) -> int:
        return 0

    def _make_room(self, n: int) -> None:
        cap_file = os.path.join(self.dir, "capacity")
        if not os.path.exists(cap_file):
            return
        cap = int(open(cap_file).read())
        files = [os.path.join(self.dir, f) for f in os.listdir(self.dir) if f != "capacity"]
        files.sort(key=os.path.getmtime)
        used = sum(os.path.getsize(f) for f in files)
        while files and used + n > cap:
            used -= os.path.getsize(files[0])
            os.unlink(files.pop(0))
