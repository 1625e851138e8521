"""llama.cpp itself (through llama-cpp-python, in the dev extra) as a reference computed while
the tests run.

tests/data/llama_cpp holds llama.cpp's outputs for fixed strings and prompts of the two test
models; these helpers produce the same kind of reference for everything else: the tiny Qwen
models (tests/tiny_qwen.py), held-out strings and prompts, other `tokenizer.ggml.pre` values,
and the tiny models of tests/tiny_models.py. Tests that use them skip with the reason when
llama-cpp-python is not installed or cannot run on this CPU.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

GGML_TYPE_F32 = 0  # ggml_type: an F32 KV cache, as the oracle's `f32` runs use
GGML_TYPE_F16 = 1  # llama.cpp's default KV cache, which prima's q8 mode keeps too


def require_llama_cpp() -> ModuleType:
    """The llama_cpp module, or skip the calling test with the reason: not installed, or it
    cannot run on this CPU (a build for instructions the CPU lacks dies on its first eval)."""
    llama_cpp = pytest.importorskip(
        "llama_cpp",
        reason="llama-cpp-python is not installed (pip install -e '.[dev]'); it computes the reference",
    )
    failure = _llama_cpp_failure()
    if failure:
        pytest.skip(
            f"llama-cpp-python cannot run on this CPU ({failure}); "
            "rebuild it for this machine (docs/performance.md, Method)"
        )
    return llama_cpp


# F32 and a quantized type: a build for AMX that the CPU (or its VM) does not enable runs F32
# weights and dies only on quantized ones, which it repacks for its AMX kernels.
_PROBE = """
import tempfile
from pathlib import Path
import llama_cpp
from gguf import GGMLQuantizationType
from tests.tiny_models import write_tiny_model
for qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.Q4_1):
    path = write_tiny_model(Path(tempfile.mkdtemp()) / "probe.gguf", qtype=qtype)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=16, verbose=False)
    llm.eval([1, 2, 3])
"""


@cache
def _llama_cpp_failure() -> str:
    """Why llama.cpp cannot evaluate a tiny model here, "" if it can: tried once, in a child,
    since an illegal instruction would take the test process down with it."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode == 0:
        return ""
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name}"
    return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"


def llama_tokenize(
    path: Path, texts: Sequence[str], overrides: dict[str, str] | None = None, *, add_bos: bool = False
) -> list[list[int]]:
    """llama.cpp's ids for each text, special tokens not parsed; no BOS (as the oracle's
    `tokenize`), or with `add_bos` BOS where the vocabulary says so. `overrides` replaces string
    metadata as the file is read (llama.cpp's `--override-kv`), e.g. another `tokenizer.ggml.pre`."""
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, kv_overrides=overrides, verbose=False)
    try:
        return [llm.tokenize(t.encode("utf-8"), add_bos=add_bos, special=False) for t in texts]
    finally:
        llm.close()


class LlamaF32:
    """A model in llama.cpp with the oracle's `f32` settings: F32 KV cache (or `kv_type`), no
    flash attention."""

    def __init__(self, path: Path, n_ctx: int = 512, kv_type: int = GGML_TYPE_F32) -> None:
        self._llama_cpp = require_llama_cpp()
        self._llm = self._llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=2,
            logits_all=True,
            type_k=kv_type,
            type_v=kv_type,
            flash_attn=False,
            verbose=False,
        )

    def adds_bos(self) -> bool:
        """Whether llama.cpp puts BOS before a prompt of this vocabulary."""
        return bool(self._llm._model.add_bos_token())

    def end_of_generation_ids(self) -> list[int]:
        """Every id llama.cpp ends a generation at (end of text, of turn, ...)."""
        vocab = self._llm._model.vocab
        return [i for i in range(self._llm.n_vocab()) if self._llama_cpp.llama_vocab_is_eog(vocab, i)]

    def render_chat(self, user_text: str) -> str:
        """One user message rendered with the model's own `tokenizer.chat_template`, the
        generation prompt added, by llama-cpp-python's Jinja2 chat formatter."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        model = self._llm._model
        formatter = Jinja2ChatFormatter(
            template=self._llm.metadata["tokenizer.chat_template"],
            eos_token=model.token_get_text(model.token_eos()),
            bos_token=model.token_get_text(model.token_bos()),
        )
        return formatter(messages=[{"role": "user", "content": user_text}]).prompt

    def detokenize(self, ids: Sequence[int]) -> str:
        """llama.cpp's text of `ids` (special tokens as text), invalid UTF-8 replaced."""
        return self._llm.detokenize(list(ids), special=True).decode("utf-8", errors="replace")

    def tokenize_prompt(self, text: str, add_bos: bool) -> list[int]:
        """Prompt ids with special tokens parsed, as the oracle's `prompt_token_ids`."""
        return self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def last_logits_and_greedy(
        self, prompt_ids: Sequence[int], max_tokens: int, stop_ids: Sequence[int]
    ) -> tuple[np.ndarray, list[int]]:
        """The float32 logits of the last prompt token, then argmax decoding up to `max_tokens`
        ids (a stop id ends it and is not included, as prima's `generate` does)."""
        self._llm.reset()
        self._llm.eval(list(prompt_ids))
        logits = np.array(self._llm.scores[len(prompt_ids) - 1], dtype=np.float32)
        greedy: list[int] = []
        nxt = int(np.argmax(logits))
        while len(greedy) < max_tokens and nxt not in stop_ids:
            greedy.append(nxt)
            self._llm.eval([nxt])
            nxt = int(np.argmax(self._llm.scores[self._llm.n_tokens - 1]))
        return logits, greedy

    def close(self) -> None:
        self._llm.close()


def llama_embeddings(path: Path, texts: Sequence[str], pooling: str, n_ctx: int = 512) -> np.ndarray:
    """llama.cpp's unit-length embeddings (n_texts, d_model) of `texts`, pooled `mean` or
    `last` over the final normed hidden states, F32 KV cache, BOS where the vocabulary says."""
    llama_cpp = require_llama_cpp()
    kinds = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}
    llm = llama_cpp.Llama(
        model_path=str(path),
        embedding=True,
        pooling_type=kinds[pooling],
        n_ctx=n_ctx,
        n_threads=2,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        flash_attn=False,
        verbose=False,
    )
    try:
        return np.array([llm.embed(t, normalize=True) for t in texts], dtype=np.float32)
    finally:
        llm.close()
