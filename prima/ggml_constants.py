"""gguf-py's constants (GGML type ids and block sizes, metadata value types, token types) without
the rest of gguf-py. The package's __init__ also imports its reader, writer, YAML metadata and
vocabulary code: 1.3 MiB of a daemon's resident memory that the engine never runs (it reads
GGUF files itself, prima.model.gguf_file). Its constants module imports nothing but the standard
library, so it is loaded on its own, under its own name: a later `import gguf` (the model
writers of prima.model.synth, the tests) reuses it, and gets it as its `constants` attribute
too (_ConstantsAttribute)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

MODULE = "gguf.constants"


def _load_constants() -> ModuleType:
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    package = importlib.util.find_spec("gguf")  # a top-level name: found, not imported
    locations = list(package.submodule_search_locations or []) if package else []
    path = Path(locations[0]) / "constants.py" if locations else None
    if path is None or not path.is_file():  # an unusual install: import it as usual
        return importlib.import_module(MODULE)
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        return importlib.import_module(MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE]
        raise
    if "gguf" not in sys.modules:
        sys.meta_path.insert(0, _ConstantsAttribute())
    return module


class _ConstantsAttribute(importlib.abc.MetaPathFinder):
    """Once, when the gguf package is imported: finds it as usual, and sets its `constants`
    attribute after it ran (Python sets a package's attribute for a submodule only when it loads
    that submodule, and this one was loaded already)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name != "gguf":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _SettingLoader(spec.loader)
        return spec


class _SettingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.constants = sys.modules[MODULE]


_constants = _load_constants()

GGMLQuantizationType = _constants.GGMLQuantizationType
GGML_QUANT_SIZES = _constants.GGML_QUANT_SIZES
GGUFValueType = _constants.GGUFValueType
TokenType = _constants.TokenType
