"""Write the two tiny Qwen models and llama.cpp's outputs for them into a directory, on the x86
host, for the aarch64 run (.ci/arm64/run), whose userland has no llama-cpp-python.

    python3 .ci/arm64/tiny_references.py OUT_DIR

OUT_DIR gets <tag>-f32.gguf, <tag>.json (tests/tiny_qwen.py's `llama_cpp_outputs`, each run's
logits replaced by the name of an .npy file beside it) and those .npy files. The models and the
references are the ones the x86 tests use: made by tests/conftest.py's own functions.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `tests`

from tests.conftest import load_tiny_oracle, tiny_model_path
from tests.tiny_qwen import TINY_TAGS


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for tag in TINY_TAGS:
        shutil.copyfile(tiny_model_path(tag), out / f"{tag}-f32.gguf")
        outputs = load_tiny_oracle(tag)
        for i, prompt in enumerate(outputs["prompts"]):
            for run in ("f32", "quant"):
                name = f"{tag}.{i}.{run}.npy"
                np.save(out / name, prompt[run].pop("logits"))
                prompt[run]["logits_file"] = name
        (out / f"{tag}.json").write_text(json.dumps(outputs), encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
