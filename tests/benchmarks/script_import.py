"""Import a measurement script by its path, as it runs by hand.

`import_script(path)` -> the module of the script at `path`, named after its file: its folder first on sys.path
(for siblings it imports: `_shared`, `reference_moe`), and the module in sys.modules while it runs and after
(dataclasses look their module up while a class is made). Each call executes the file afresh.
"""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_script(path: Path):
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
