"""A model bigger than the budget runs on one device by streaming its layers: same tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prima.engine.generate import generate
from prima.engine.local import LocalEngine, local_engine
from prima.engine.sampling import SamplerConfig
from prima.forward.loader import LoadedModel, load_model


def test_streaming_engine_gives_the_same_tokens(private_copy: Path) -> None:
    loaded = load_model(private_copy, mode="exact", threads=1)
    prompt = loaded.tokenizer.encode("The capital of France is", add_bos=True)
    expected = generate(LocalEngine(loaded.model, n_ctx=64), prompt, max_tokens=8, sampler=SamplerConfig())
    owned = _owned(loaded)
    engine = local_engine(loaded, 64, budget_bytes=owned // 3)
    try:
        assert engine.streamer is not None
        assert engine.streamer.limited
        got = generate(engine, prompt, max_tokens=8, sampler=SamplerConfig())
        stats = engine.streamer.stats
        assert got.token_ids == expected.token_ids
        # Every pass reread the streamed layers, and compute never had to fault one in.
        assert stats.bytes_read >= 8 * engine.streamer.streamed_bytes_per_pass
        assert stats.misses == 0
        assert engine.streamer.residency().peak_resident_bytes <= owned // 3 + (64 << 12)
    finally:
        engine.close()


def test_streaming_prefill_reads_each_layer_once(private_copy: Path) -> None:
    """Micro-batches of one prompt go through each streamed layer together (layer-major)."""
    loaded = load_model(private_copy, mode="exact", threads=1)
    prompt = loaded.tokenizer.encode("One, two, three, four, five, six, seven, eight", add_bos=True)
    plain = LocalEngine(loaded.model, n_ctx=64, ubatch=3)
    expected = plain.forward(prompt)
    engine = local_engine(loaded, 64, budget_bytes=_owned(loaded) // 3, ubatch=3)
    try:
        assert engine.streamer is not None
        got = engine.forward(prompt)
        assert len(prompt) > 2 * 3  # three micro-batches or more
        assert np.array_equal(got, expected)
        streamer = engine.streamer
        pinned = sum(streamer._bytes[i] for i in streamer.pinned)
        # One pass of streamed layers (the thread may have read ahead into the next).
        assert streamer.stats.bytes_read <= pinned + 2 * streamer.streamed_bytes_per_pass
    finally:
        engine.close()


def _owned(loaded: LoadedModel) -> int:
    ranges = [
        loaded.gguf.byte_range(loaded.weights.layer_tensor_names(i))
        for i in range(loaded.model.config.n_layers)
    ]
    return sum(hi - lo for lo, hi in ranges)


def test_engine_does_not_stream_when_the_model_fits(smollm2_path: Path) -> None:
    loaded = load_model(smollm2_path, threads=1)
    engine = local_engine(loaded, 64, budget_bytes=1 << 40)
    assert engine.streamer is None
    engine.close()
