"""The acl backend through FakeAcl (a stand-in for Huawei's pyACL: no NPU result here) and the
stand-in ATC: every failure reaches the user as an AclError saying what to do; the KV cache
stays in device buffers; windows are compiled once and cached; released windows and caches give
their device memory back. The conformance suite (tests/backends/test_conformance.py) holds the
backend to llama.cpp's logits."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prima.backends import get_backend
from prima.errors import ContextFullError, InputError
from prima.model.files import open_model
from tests.conftest import load_tiny_oracle, tiny_model_path

pytest.importorskip("onnxruntime")

import prima.backends.acl.runtime as runtime
from prima.backends.acl import AclBackend, AclError
from prima.backends.acl.runtime import ERRORS, describe, import_acl
from tests.backends.acl.fake_acl import FakeAcl, fake_cann

IDS = np.array([9707, 11, 1879, 0, 42, 7, 3])


@pytest.fixture
def cann(tmp_path: Path) -> Iterator[FakeAcl]:
    with fake_cann(tmp_path) as fake:
        yield fake


def _backend(**kwargs: object) -> AclBackend:
    return AclBackend(open_model(tiny_model_path("tiny-qwen3")).weights, threads=1, ctx=64, **kwargs)


def test_kv_stays_in_device_buffers_and_is_freed(cann: FakeAcl) -> None:
    backend = _backend()
    n = backend.config.n_layers
    window = backend.load_window(range(n))
    kv = backend.new_kv(64, range(n))
    h = backend.run_window(window, backend.embed(IDS), np.arange(len(IDS)), kv)
    assert cann.executions == 3  # 7 tokens in gears of 4, 2 and 1
    # the cache rows are in the fake device's memory, where the next call reads them
    row = np.frombuffer(bytes(cann._resolve(kv.k[0], kv.row_bytes * len(IDS))), np.float32)
    assert np.abs(row).max() > 0
    h2 = backend.run_window(window, backend.embed(np.array([5])), np.array([len(IDS)]), kv)
    assert h.shape == (len(IDS), backend.config.d_model)
    assert h2.shape == (1, backend.config.d_model)
    with pytest.raises(ContextFullError):
        backend.run_window(window, backend.embed(np.array([5])), np.array([64]), kv)
    kv.free()
    backend.release_window(window)
    assert cann.used_bytes == 0
    with pytest.raises(AclError, match="released"):
        backend.run_window(window, backend.embed(np.array([5])), np.array([0]), kv)
    backend.close()
    assert not cann.initialized


def test_windows_are_compiled_once_and_cached(cann: FakeAcl, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend()
    backend.release_window(backend.load_window(range(1)))
    monkeypatch.setenv("PATH", "/nonexistent")  # no ATC now: the cached offline model must do
    backend.release_window(backend.load_window(range(1)))
    with pytest.raises(AclError, match="ATC .* is not on PATH"):
        backend.load_window(range(1, 2))
    backend.close()


def test_a_context_beyond_the_compiled_slots_is_refused(cann: FakeAcl) -> None:
    backend = _backend()
    with pytest.raises(InputError, match="64 KV slots .*--npu-ctx"):
        backend.new_kv(65, range(1))
    backend.close()


@pytest.mark.parametrize(
    ("call", "code", "message"),
    [
        ("rt.malloc", 207001, "out of NPU memory"),
        ("mdl.load_from_file", 100013, "recompile"),
        ("mdl.load_from_file", 100014, "delete it from the acl cache"),
    ],
)
def test_load_failures_become_errors_that_say_what_to_do(
    cann: FakeAcl, call: str, code: int, message: str
) -> None:
    backend = _backend()
    cann.fail(call, code)
    with pytest.raises(AclError, match=message) as err:
        backend.load_window(range(1))
    assert err.value.code == code
    backend.close()


@pytest.mark.parametrize(
    ("call", "code", "message"),
    [
        ("rt.synchronize_stream", 500003, "NPU runtime failed"),  # the run failed on the device
        ("mdl.execute_async", 207001, "out of NPU memory"),
        ("rt.memcpy", 100000, "bug in prima"),
    ],
)
def test_run_failures_become_errors_that_say_what_to_do(
    cann: FakeAcl, call: str, code: int, message: str
) -> None:
    backend = _backend()
    window, kv = backend.load_window(range(1)), backend.new_kv(64, range(1))
    h = backend.embed(IDS[:1])
    cann.fail(call, code)
    with pytest.raises(AclError, match=message) as err:
        backend.run_window(window, h, np.array([0]), kv)
    assert f"acl call {call} failed with code {code}" in str(err.value)
    backend.close()


def test_a_device_that_is_not_there_is_named(cann: FakeAcl) -> None:
    cann.fail("rt.set_device", 207004)
    with pytest.raises(AclError, match="not available; check `npu-smi info`"):
        _backend()


def test_every_known_code_has_its_own_message() -> None:
    for code in ERRORS:
        text = describe("mdl.execute", code)
        assert f"code {code}: {ERRORS[code]}" in text
    assert "CANN logs" in describe("mdl.execute", 123456)


def test_out_of_device_memory_names_the_fix(tmp_path: Path) -> None:
    with fake_cann(tmp_path, memory_bytes=4096):
        backend = _backend()
        with pytest.raises(AclError, match="out of NPU memory; give the NPU fewer layers"):
            backend.load_window(range(2))
        backend.close()


def test_missing_cann_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "acl", None)  # `import acl` fails
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    with pytest.raises(AclError, match="CANN toolkit .*set_env.sh"):
        import_acl()
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", "/usr/local/Ascend/ascend-toolkit/latest")
    with pytest.raises(AclError, match="source \\$ASCEND_TOOLKIT_HOME/set_env.sh"):
        import_acl()
    with pytest.raises(AclError, match="CANN"):
        get_backend("acl", open_model(tiny_model_path("tiny-qwen2")).weights)


def test_a_standin_is_loaded_only_when_it_says_what_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon process gets FakeAcl through $PRIMA_TEST_ACL_STANDIN; nothing else passes."""
    monkeypatch.setattr(runtime, "_STANDINS", {})  # a clean table, restored afterwards
    monkeypatch.setenv(runtime.STANDIN_ENV, "tests.backends.acl.fake_acl:FakeAcl")
    fake = import_acl()
    assert isinstance(fake, FakeAcl)
    assert import_acl() is fake  # one per process, as a module
    for spec, message in [
        ("fake_acl", "expected module:factory"),
        ("tests.backends.acl.no_such:FakeAcl", "cannot load it"),
        ("numpy:zeros", "does not declare STANDS_IN_FOR"),
    ]:
        monkeypatch.setenv(runtime.STANDIN_ENV, spec)
        with pytest.raises(AclError, match=message):
            import_acl()


def test_a_float16_kv_cache_takes_half_the_device_memory_within_the_tolerance(cann: FakeAcl) -> None:
    """The device KV cache in float16 (the default) against float32: half the bytes, and the
    prompt's logits within the backend's stated tolerance of llama.cpp's either way (measured
    on the tiny models, the stand-in rounding as float16 MatMuls do: <= 0.036 for both)."""
    prompt = load_tiny_oracle("tiny-qwen3")["prompts"][1]
    ids = np.array(prompt["prompt_token_ids"])
    want = prompt["f32"]["logits"]
    kv_bytes = {}
    for kv_dtype in ("float16", "float32"):
        backend = _backend(kv_dtype=kv_dtype)
        n = backend.config.n_layers
        window, kv = backend.load_window(range(n)), backend.new_kv(64, range(n))
        before = cann.used_bytes
        kv_bytes[kv_dtype] = kv.n_bytes
        h = backend.run_window(window, backend.embed(ids), np.arange(len(ids)), kv)
        assert np.abs(backend.logits(h[-1:])[0] - want).max() <= backend.logit_tolerance
        kv.free()
        assert before - cann.used_bytes == kv_bytes[kv_dtype]  # what it holds on the device
        backend.release_window(window)
        backend.close()
    assert kv_bytes["float32"] == 2 * kv_bytes["float16"]
    with pytest.raises(InputError, match="float16 or float32"):
        _backend(kv_dtype="bfloat16")
