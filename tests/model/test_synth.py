"""Synthetic models: the file loads in prima and in llama.cpp, and both read it the same way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prima.cli.main import main as prima_main
from prima.engine.generate import generate
from prima.engine.local import LocalEngine
from prima.engine.sampling import SamplerConfig
from prima.errors import InputError
from prima.forward.loader import load_model
from prima.model.gguf_file import GGUFFile
from prima.model.synth import SynthSpec, spec_for_size, write_synth_model
from prima.scheduler.profile_schema import ModelProfile
from tests.llama_reference import require_llama_cpp

SMALL = {"n_layers": 3, "d_model": 128, "ffn": 256, "n_heads": 4, "n_kv_heads": 2}


@pytest.fixture(scope="module")
def synth_path(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synth_model(tmp_path_factory.mktemp("synth") / "s.gguf", SynthSpec(**SMALL), smollm2_path)


def test_synth_model_has_the_shape_asked_for(synth_path: Path, smollm2_path: Path) -> None:
    spec = SynthSpec(**SMALL)
    with GGUFFile(synth_path) as gguf, GGUFFile(smollm2_path) as source:
        profile = ModelProfile.from_gguf(gguf)
        assert profile.n_layers == 3
        assert profile.layer_bytes == spec.layer_bytes()
        assert not profile.tied_output
        assert gguf.metadata["tokenizer.ggml.tokens"] == source.metadata["tokenizer.ggml.tokens"]
        assert gguf.metadata["tokenizer.ggml.merges"] == source.metadata["tokenizer.ggml.merges"]


def test_synth_model_runs_like_llama_cpp_reads_it(synth_path: Path) -> None:
    """prima (exact mode) and llama.cpp give the same greedy tokens from the synthetic file."""
    llama_cpp = require_llama_cpp()
    loaded = load_model(synth_path, mode="exact", threads=1)
    prompt = loaded.tokenizer.encode("The capital of France is", add_bos=True)
    ours = generate(LocalEngine(loaded.model, n_ctx=64), prompt, max_tokens=6, sampler=SamplerConfig())
    llm = llama_cpp.Llama(model_path=str(synth_path), n_ctx=64, n_threads=1, verbose=False, logits_all=False)
    theirs = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        theirs.append(int(tok))
        if len(theirs) == 6:
            break
    assert ours.token_ids == theirs


def test_spec_for_size_picks_the_layer_count() -> None:
    spec = spec_for_size(1_000_000_000, 49152, d_model=2048, ffn=8192)
    embed = 49152 * 2048 // 32 * 20
    total = spec.n_layers * spec.layer_bytes() + 2 * embed
    assert abs(total - 1_000_000_000) <= spec.layer_bytes() / 2


def test_unwritable_output_is_an_input_error(tmp_path: Path, smollm2_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(InputError, match="cannot write"):
        write_synth_model(blocker / "model.gguf", SynthSpec(**SMALL), smollm2_path)


def test_bad_synth_shapes_are_input_errors() -> None:
    with pytest.raises(InputError, match="heads"):
        SynthSpec(d_model=100, n_heads=3)
    with pytest.raises(InputError, match="cannot be synthesized"):
        SynthSpec(qtype="IQ2_XXS")
    with pytest.raises(InputError, match="llama, qwen2 or qwen3"):
        SynthSpec(arch="gemma3")


def test_cli_writes_a_model_that_loads(
    tmp_path: Path, smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.gguf"
    argv = ["models", "synth", str(out), "--layers", "2", "--d-model", "64", "--ffn", "128", "--heads", "2"]
    argv += ["--kv-heads", "1", "--arch", "qwen2", "--type", "Q8_0", "--tokenizer-from", str(smollm2_path)]
    assert prima_main(argv) == 0
    assert "qwen2 2 layers" in capsys.readouterr().out
    loaded = load_model(out, threads=1)
    logits = LocalEngine(loaded.model, n_ctx=16).forward([1, 2, 3])
    assert logits.shape == (loaded.model.config.vocab_size,)
    assert np.isfinite(logits).all()
