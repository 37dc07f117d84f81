"""Stand-in for transformer_engine (which needs a GPU to install), so that Megatron-Bridge's modules import on
CPU. Every attribute of ``transformer_engine`` and of any ``transformer_engine.*`` module is a placeholder
class (subclassable, with placeholder attributes of its own): enough for class definitions and imports at
module level. Nothing here computes anything; the Bridge tests never build a Transformer Engine layer."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "2.8.0"


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _placeholder(name):
    return _Placeholder(name, (), {"__module__": "transformer_engine"})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
