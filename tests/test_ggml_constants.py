"""The engine uses gguf-py's constants without importing the rest of gguf-py (its reader,
writer and YAML metadata code: resident memory the engine never runs), and a later
`import gguf` still gets the whole package with those same constants."""

from __future__ import annotations

import json

from tests.conftest import run_python

CHECK = """
import json, sys
from prima.forward.loader import load_model
from prima.engine.local import LocalEngine
from prima.ggml_constants import GGMLQuantizationType
before = {"gguf": "gguf" in sys.modules, "quants": "gguf.quants" in sys.modules}
import gguf
from gguf import GGUFReader
print(json.dumps({
    **before,
    "same_constants": gguf.constants is sys.modules["gguf.constants"],
    "same_enum": gguf.GGMLQuantizationType is GGMLQuantizationType,
    "q4_1": int(GGMLQuantizationType.Q4_1),
}))
"""


def test_the_engine_imports_gguf_constants_alone_and_gguf_still_imports_whole() -> None:
    seen = json.loads(run_python(CHECK, timeout=120).stdout)
    assert seen == {"gguf": False, "quants": False, "same_constants": True, "same_enum": True, "q4_1": 3}
