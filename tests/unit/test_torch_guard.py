"""torch_guard.py and its .pth file: a CUDA-linked torchvision beside a CPU torch reads as
absent; CPU builds, and anything beside a CUDA torch, are left alone. Packages are built
here with gcc (real ELF libraries), and the wheel with pip."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from ascend_store.ops.torch_guard import needed_libraries

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GCC = shutil.which("gcc")
needs_gcc = pytest.mark.skipif(GCC is None, reason="needs gcc")


def _readelf_needed(path: str) -> list[bytes]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [ln.split("[", 1)[1].split("]", 1)[0].encode() for ln in out.splitlines() if "(NEEDED)" in ln]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_needed_libraries_are_readelfs():
    import torch

    libs = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "*.so")))[:6]
    libs += glob.glob(os.path.join(os.path.dirname(torch.__file__), "_C*.so"))
    assert libs
    for lib in libs:
        assert needed_libraries(lib) == _readelf_needed(lib), lib
    assert needed_libraries(os.path.join(REPO, "README.md")) == []  # not an ELF file


def _library(path: str, *links: str) -> None:
    """A shared library at ``path`` whose DT_NEEDED holds ``links`` (built beside it)."""
    src = path + ".c"
    with open(src, "w") as f:
        f.write("int ascend_store_probe(void) { return 1; }\n")
    folder = os.path.dirname(path)
    subprocess.run([GCC, "-shared", "-fPIC", "-o", path, src, f"-L{folder}", "-Wl,--no-as-needed",
                    *[f"-l:{name}" for name in links]], check=True)


def _site(tmp_path, torch_cuda: bool, vision_links: tuple[str, ...]) -> str:
    """A directory with a torch (with or without its CUDA library) and a torchvision whose
    _C library needs ``vision_links``."""
    site = tmp_path / "site"
    (site / "torch" / "lib").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    (site / "torchvision").mkdir()
    (site / "torchvision" / "__init__.py").write_text("")
    for name in ("libtorch_cuda.so", "libc10_cuda.so", "libtorch_cpu.so"):
        _library(str(site / "torch" / "lib" / name))
    if not torch_cuda:
        os.unlink(site / "torch" / "lib" / "libtorch_cuda.so")
    for name in vision_links:  # what the library links, found beside it
        shutil.copy(site / "torch" / "lib" / "libtorch_cpu.so", site / "torchvision" / name)
    _library(str(site / "torchvision" / "_C.so"), *vision_links)
    return str(site)


PROBE = ("import importlib.util, site, sys\n"
         "site.addsitedir(sys.argv[1])\n"  # puts it on the path, then runs the .pth there
         "try:\n"
         "    import torchvision\n"
         "    print('imported', importlib.util.find_spec('torchvision') is not None)\n"
         "except ModuleNotFoundError:\n"
         "    print('absent', importlib.util.find_spec('torchvision') is not None)\n")


@pytest.fixture(scope="module")
def pth(tmp_path_factory) -> bytes:
    """The .pth file of this package's wheel, built from the files deploy/Dockerfile copies
    (in a copy: setuptools builds in place)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(os.path.join(REPO, "ascend_store"), src / "ascend_store",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(REPO, name), src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = glob.glob(str(tmp / "ascend_store-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        assert "ascend_store/ops/torch_guard.py" in z.namelist()
        return z.read("ascend_store-torch-guard.pth")  # at the wheel's root: site-packages


def _probe(site: str, pth: bytes) -> str:
    with open(os.path.join(site, "ascend_store-torch-guard.pth"), "wb") as f:
        f.write(pth)
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-S", "-c", PROBE, site], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@needs_gcc
def test_a_cuda_torchvision_beside_a_cpu_torch_reads_as_absent(tmp_path, pth):
    site = _site(tmp_path, torch_cuda=False, vision_links=("libc10_cuda.so", "libtorch_cpu.so"))
    assert _probe(site, pth) == "absent False"


@needs_gcc
@pytest.mark.parametrize("torch_cuda, links", [(False, ("libtorch_cpu.so",)),  # a CPU build
                                               (True, ("libtorch_cuda.so",))])  # beside a CUDA torch
def test_torchvision_that_can_load_is_left_alone(tmp_path, pth, torch_cuda, links):
    assert _probe(_site(tmp_path, torch_cuda=torch_cuda, vision_links=links), pth) == "imported True"
