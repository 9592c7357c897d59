"""The project's scripts (tools/*.py, benchmarks/*.py) as modules for the tests, loaded by path: neither folder is a
package, and a script imports its siblings (benchmarks' bench_output) from its own folder, as when it runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """``load_script("tools/plan.py")``: the file run as a module named after its folder and stem
    (``spindle_tools_plan``), registered in sys.modules (dataclasses look their module up while the file runs)."""
    path = ROOT / relative_path
    name = f"spindle_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module
