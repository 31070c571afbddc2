"""SGLang's CPU kernels are not built here; its torch-native paths run.

SGLang imports `sgl_kernel` (its compiled kernel package) at module level all over, also on the CPU path. The
registry's `sglang-kernel` wheel holds CUDA ops only and has no source package, so its CPU build cannot be made on
a machine without a toolchain for it. This package stands in for it in the SGLang environment the tests install
(`tests/engines/install_sglang.sh`): every attribute of it, and of any `sgl_kernel.<sub>` module, is a function that
raises when called. With `--device cpu --attention-backend torch_native` SGLang calls none of them; one that is
called fails loudly, naming itself, instead of computing anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class KernelNotBuilt(RuntimeError):
    """An `sgl_kernel` function was called: the CPU kernels are not built in this environment."""


class _Missing:
    """A kernel (or a constant of the kernel package, such as `scalar_types.uint4b8`) that is not built: raises
    when called; its attributes are more of the same, so module-level lookups in SGLang still import."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise KernelNotBuilt(
            f"{self._qualname}: SGLang's CPU kernels are not built here (sgl_kernel is an import shim); "
            "this SGLang path needs them"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel shim {self._qualname}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):  # dunders (__path__, __version__, ...) are absent, as on a real module
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return _Missing(f"{module_name}.{name}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves any `sgl_kernel.<sub>` import as a module like this one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


__getattr__ = _module_getattr(__name__)
sys.meta_path.insert(0, _SubmoduleFinder())
