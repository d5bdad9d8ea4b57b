"""The import hook behind deepcompile_remat_autoinstall.pth: waits for `import deepspeed`, then
hands DeepSpeed's module to autoinstall.wrap() before the import statement returns.

deepcompile_remat_autoinstall.pth (a file of this folder, which setup.py puts in site-packages,
for a wheel and for `pip install -e .` alike) runs at every interpreter start. Its one line
loads this file by its path, as the top-level module NAME (not as
deepcompile_remat.deepspeed._import_hook: importing the package costs ~50 ms and a compiled
extension), and calls register(). So this module imports nothing but `sys` at start: no torch,
no deepspeed, no deepcompile_remat. register() puts one finder at the front of sys.meta_path;
for every import but `deepspeed` it answers None at once. For `deepspeed` it asks the finders
behind it for the spec and wraps its loader: DeepSpeed's own loader runs deepspeed/__init__.py,
then autoinstall.wrap(module) (torch and DeepSpeed are loaded by then, so importing
deepcompile_remat costs nothing that counts), and the finder leaves sys.meta_path. Nothing here
raises into an import: a failure of wrap() is one WARNING saying the block is then honoured
only after deepcompile_remat.deepspeed.install().
"""
import sys

NAME = "_deepcompile_remat_import_hook"  # this module's name in sys.modules, set by the .pth
TARGET = "deepspeed"


class _WrapAfterExec:
    """DeepSpeed's loader, and autoinstall.wrap() right after it has run deepspeed/__init__.py.
    The module's __loader__ and __spec__.loader are DeepSpeed's own loader again afterwards."""

    def __init__(self, loader, finder):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)  # raises as DeepSpeed's import would: we are not reached
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._finder.remove()
        _wrap(module)

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: DeepSpeed's loader's
        return getattr(self._loader, name)


def _wrap(module) -> None:
    try:
        from deepcompile_remat.deepspeed import autoinstall

        autoinstall.wrap(module)
    except Exception as e:  # never into `import deepspeed`
        import logging

        logging.getLogger("deepcompile_remat").warning(
            "deepcompile_remat: the import hook could not wrap deepspeed.initialize (%s: %s); a "
            "\"deepcompile_remat\" block is honoured only after "
            "deepcompile_remat.deepspeed.install()", type(e).__name__, e)


class DeepSpeedImportHook:
    """A sys.meta_path finder for `deepspeed` only: the spec the finders behind it give, its
    loader wrapped (_WrapAfterExec). One per process (register())."""

    def find_spec(self, fullname, path=None, target=None):
        """None but for `deepspeed`: then the next finder's spec, with its loader wrapped."""
        if fullname != TARGET:
            return None
        spec = None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _WrapAfterExec(spec.loader, self)
        return spec

    def remove(self) -> None:
        """Off sys.meta_path (after DeepSpeed's import: one wrap per process)."""
        while self in sys.meta_path:
            sys.meta_path.remove(self)

    def __repr__(self):
        return f"<{NAME}.DeepSpeedImportHook>"


def register() -> None:
    """The finder at the front of sys.meta_path, once; where `deepspeed` is imported already
    (a .pth before ours imported it), wrap() at once. Never raises."""
    try:
        module = sys.modules.get(TARGET)
        if module is not None:
            _wrap(module)
        elif not any(isinstance(f, DeepSpeedImportHook) for f in sys.meta_path):
            sys.meta_path.insert(0, DeepSpeedImportHook())
    except Exception:  # noqa: BLE001: interpreter start; wrap() reports its own failures
        pass
