"""Loading the Python code a recipe names by 'package.module:name' or 'path/to/file.py:name' (an
agent, an environment's factory): the module, found the one way for both spellings, so that every
setting that names code reads it alike."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_module(target: str, prefix: str) -> ModuleType:
    """The module `target` names: a dotted module imported as usual, or a '.py' file (from the
    working directory) loaded as the module `<prefix>_<its stem>`. Raises what the loading raised
    (FileNotFoundError for a file that is not there), for the caller to locate."""
    if not target.endswith(".py"):
        return importlib.import_module(target)
    path = Path(target)
    if not path.is_file():
        raise FileNotFoundError(f"no file {path.resolve()}")
    found = importlib.util.spec_from_file_location(f"{prefix}_{path.stem}", path)
    assert found is not None and found.loader is not None  # a .py file always has its loader
    module = importlib.util.module_from_spec(found)
    sys.modules[found.name] = module
    found.loader.exec_module(module)
    return module
