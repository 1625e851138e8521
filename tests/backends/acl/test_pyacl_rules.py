"""The rules of Huawei's pyACL that the acl backend depends on, one test each: the stand-in
(FakeAcl, tests/backends/acl/fake_acl.py) enforces each rule as the documentation states it, and
prima keeps to it. Each rule is listed with its source in docs/backends.md; ATC's rules are
tested in test_atc.py. Nothing here ran on an NPU."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from prima.model.files import open_model
from tests.conftest import tiny_model_path

pytest.importorskip("onnxruntime")

from prima.backends.acl import AclBackend, AclError
from prima.backends.acl.atc import full_dims
from prima.backends.acl.runtime import DYNAMIC_DIMS_INPUT, MAX_DIM_CNT, output_name
from tests.backends.acl.fake_acl import INVALID_PARAM, RT_CONTEXT_NULL, FakeAcl, fake_cann

IDS = np.array([9707, 11, 1879])


@pytest.fixture
def cann(tmp_path: Path) -> Iterator[FakeAcl]:
    with fake_cann(tmp_path) as fake:
        yield fake


def _backend() -> AclBackend:
    return AclBackend(open_model(tiny_model_path("tiny-qwen3")).weights, threads=1, ctx=64)


def _in_thread(fn: Callable[[], Any]) -> Any:
    """fn() on a new thread, as a daemon's RPC and compute threads call the backend."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised on the calling thread
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_output_names_are_read_from_what_the_runtime_reports(cann: FakeAcl) -> None:
    """aclmdlGetOutputNameByIndex answers "<op name>:<edge index>:<output name>" for a model ATC
    built from ONNX; prima binds its buffers by the output name in it."""
    backend = _backend()
    window = backend.load_window(range(2))
    reported = [cann.mdl.get_output_name_by_index(window.model.desc, i) for i in range(3)]
    assert [r.split(":")[1:] for r in reported] == [["0", name] for name in window.graph.outputs]
    assert window.model.outputs == window.graph.outputs
    assert output_name("n_concat_7:0:new_k") == "new_k"
    assert output_name("a:b:1:hidden_out") == "hidden_out"  # op names may hold colons
    backend.release_window(window)
    backend.close()


def test_a_gear_is_set_by_the_full_shape_of_every_input(
    cann: FakeAcl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclmdlSetInputDynamicDims takes the full shape of every input, concatenated, the gear's
    values in place of the -1s; the dynamic values alone are refused (ACL_ERROR_INVALID_PARAM)."""
    backend = _backend()
    window, kv = backend.load_window(range(2)), backend.new_kv(64, range(2))
    seen: list[dict[str, Any]] = []
    real = cann.mdl_set_input_dynamic_dims

    def recording(model_id: int, ds: Any, index: int, dims: dict[str, Any]) -> int:
        seen.append(dims)
        return real(model_id, ds, index, dims)

    monkeypatch.setattr(cann, "mdl_set_input_dynamic_dims", recording)
    backend.run_window(window, backend.embed(IDS), np.arange(3), kv)  # gears of 2 and 1 tokens
    graph = window.graph
    assert [d["dims"] for d in seen] == [full_dims(graph, graph.inputs, n) for n in (2, 1)]
    assert all(d["dimCount"] == len(d["dims"]) == 14 for d in seen)  # 2 + 1 + 3 + 4 + 4
    inputs = [window.buffers.get(name, (0, 0)) for name in window.model.inputs]
    with pytest.raises(AclError, match="code 100000") as err:  # n, n, n, ctx + n alone
        backend.runtime.execute(
            window.model, inputs, [window.buffers[o] for o in graph.outputs], [1, 1, 1, 65]
        )
    assert err.value.code == INVALID_PARAM
    backend.release_window(window)
    backend.close()


def test_a_gear_has_at_most_128_dims(cann: FakeAcl) -> None:
    """aclmdlIODims holds ACL_MAX_DIM_CNT (128) dims, and pyACL copies a gear into it unchecked:
    the stand-in refuses more, and prima never passes more."""
    backend = _backend()
    window = backend.load_window(range(1))
    ds = cann.mdl.create_dataset()
    index, _ = cann.mdl.get_input_index_by_name(window.model.desc, DYNAMIC_DIMS_INPUT)
    too_many = {"dimCount": MAX_DIM_CNT + 1, "name": "", "dims": [1] * (MAX_DIM_CNT + 1)}
    assert cann.mdl.set_input_dynamic_dims(window.model.model_id, ds, index, too_many) == INVALID_PARAM
    with pytest.raises(AclError, match="exceeds pyACL's 128"):
        backend.runtime.execute(window.model, [], [], [1] * (MAX_DIM_CNT + 1))
    backend.release_window(window)
    backend.close()


def test_every_thread_that_calls_the_runtime_needs_a_current_context(cann: FakeAcl) -> None:
    """The context is per thread: a thread with none gets ACL_ERROR_RT_CONTEXT_NULL (107002).
    prima loads a window on one thread and runs it on another, as a daemon does."""
    backend = _backend()
    assert _in_thread(lambda: cann.rt.malloc(64, 0))[1] == RT_CONTEXT_NULL
    assert _in_thread(lambda: cann.rt.get_mem_info(0))[2] == RT_CONTEXT_NULL
    window = _in_thread(lambda: backend.load_window(range(1)))
    kv = _in_thread(lambda: backend.new_kv(64, range(1)))
    h = _in_thread(lambda: backend.run_window(window, backend.embed(IDS[:1]), np.array([0]), kv))
    assert h.shape == (1, backend.config.d_model)
    assert _in_thread(backend.device_memory)[1] == cann.memory_bytes
    _in_thread(kv.free)
    _in_thread(lambda: backend.release_window(window))
    assert cann.used_bytes == 0
    backend.close()


def test_device_memory_is_the_hosts_where_the_soc_shares_it(tmp_path: Path) -> None:
    """get_mem_info answers an HBM query from DDR on the 310B's class of device, and where the
    device's DDR is the host's memory (shared_host) it reports the host's."""
    with fake_cann(tmp_path, memory_bytes=1 << 30, shared_host=True) as cann:
        backend = _backend()
        assert backend.shares_ram  # Ascend310B1, the default SoC
        free, total = backend.device_memory()
        assert total == psutil.virtual_memory().total != cann.memory_bytes
        assert 0 < free <= total
        assert cann.rt.get_mem_info(1)[1] == cann.rt.get_mem_info(0)[1] == total  # HBM is DDR here
        backend.close()


def test_host_arrays_reach_the_device_without_numpy_to_ptr(
    cann: FakeAcl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CANN's pyACL is built against numpy 1.x, and acl.util.numpy_to_ptr imports numpy's C API
    (the stand-in's fails under numpy 2): prima takes host addresses from ndarray.ctypes."""
    if int(np.__version__.split(".")[0]) >= 2:
        with pytest.raises(ImportError, match="numpy 1.x"):
            cann.util.numpy_to_ptr(np.zeros(4, np.float32))

    def refused(array: np.ndarray) -> int:
        raise AssertionError("prima called acl.util.numpy_to_ptr")

    monkeypatch.setattr(cann, "util_numpy_to_ptr", refused)
    backend = _backend()
    window, kv = backend.load_window(range(1)), backend.new_kv(64, range(1))
    h = backend.run_window(window, backend.embed(IDS), np.arange(3), kv)
    assert np.isfinite(h).all()
    backend.release_window(window)
    backend.close()
