"""The optimizer library (`foovb`) stands on torch alone: importing any of its modules imports neither the
continual-learning suite (`foovb_suite`) nor any of the suite's dependencies that torch itself does not import."""

import pkgutil
import subprocess
import sys

import foovb

SUITE_ONLY = ("foovb_suite", "numpy", "yaml", "matplotlib", "tqdm", "scipy")


def test_the_library_imports_no_suite_module_or_dependency():
    modules = ["foovb"] + [f"foovb.{info.name}" for info in pkgutil.iter_modules(foovb.__path__)]
    assert {"foovb.optimizer", "foovb.predict", "foovb.distributed", "foovb.posteriors"} <= set(modules)
    code = (f"import importlib, sys, torch\ntorch_imports = set(sys.modules)\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            f"print(sorted(m for m in set(sys.modules) - torch_imports if m.split('.')[0] in {SUITE_ONLY!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
