"""Everything is in pyproject.toml but one file: ``ascend_store-torch-guard.pth``, written
beside the package in site-packages so that ``ascend_store/ops/torch_guard.py`` runs at
interpreter start (a wheel's ``.pth`` file must sit at its root, where setuptools puts only
packages). Editable installs do not get it."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "ascend_store-torch-guard.pth"


class BuildPy(build_py):
    def run(self):
        super().run()
        with open(os.path.join(self.build_lib, PTH), "w") as f:
            f.write("import ascend_store.ops.torch_guard\n")

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPy})
