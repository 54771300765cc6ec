"""Imported at start-up by the Python processes the tests start (`helpers.run_python` puts this
folder on their PYTHONPATH): when such a process imports JAX, it compiles as the test session
does (`helpers.set_suite_cpu_compile_options`) and collects garbage as it does
(`helpers.collect_garbage_less_often`). Nothing is imported before JAX is."""

import importlib.abc
import importlib.util
import pathlib
import sys


_MODULE = "jax._src.compiler"


def _hook():
    spec = importlib.util.spec_from_file_location(
        "_test_helpers", pathlib.Path(__file__).resolve().parent.parent / "helpers.py"
    )
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    helpers.set_suite_cpu_compile_options()
    helpers.collect_garbage_less_often()


class _AfterCompilerImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _hook()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterCompilerImport())
