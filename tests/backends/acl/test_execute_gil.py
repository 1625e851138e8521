"""pyACL's acl.mdl.execute holds the GIL until the NPU is done (its wrapper calls aclmdlExecute
without releasing it), while acl.rt.synchronize_stream waits with it released; so the acl
backend runs a window with execute_async and synchronize_stream, and a daemon's other threads
(network, prefetch) run while the NPU computes. FakeAcl models the device's compute time
(`device_seconds`) as pyACL spends it: inside execute with the GIL held, inside
synchronize_stream without it (no NPU here). Nothing is timed: a watcher thread woken when the
device starts asks whether it is still computing."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from prima.model.files import open_model
from tests.conftest import tiny_model_path

pytest.importorskip("onnxruntime")

from prima.backends.acl import AclBackend
from tests.backends.acl.fake_acl import FakeAcl, fake_cann

DEVICE_SECONDS = 0.5  # each execution's modelled NPU time


@pytest.fixture
def cann(tmp_path: Path) -> Iterator[FakeAcl]:
    with fake_cann(tmp_path) as fake:
        yield fake


def _ran_during_the_device_time(fake: FakeAcl, work: Callable[[], object]) -> bool:
    """Whether a Python thread woken as the device starts ran before the device was done, while
    `work` drives it. A long switch interval: the GIL changes hands only when a thread waits."""
    seen: list[bool] = []

    def watch() -> None:
        if fake.device_started.wait(timeout=60):
            seen.append(fake.device_computing())

    fake.device_seconds = DEVICE_SECONDS
    fake.device_started.clear()
    watcher = threading.Thread(target=watch)
    interval = sys.getswitchinterval()
    watcher.start()
    sys.setswitchinterval(1.0)
    try:
        work()
    finally:
        sys.setswitchinterval(interval)
        watcher.join(timeout=60)
        fake.device_seconds = 0.0
    assert seen, "the device never started"
    return seen[0]


def test_the_stand_in_holds_the_gil_in_execute_and_not_in_synchronize(cann: FakeAcl) -> None:
    """The rule itself, on the stand-in's calls: nothing else runs inside execute; a thread runs
    while synchronize_stream waits; and execute_async's outputs exist only after it."""
    backend = AclBackend(open_model(tiny_model_path("tiny-qwen3")).weights, threads=1, ctx=64)
    rt = backend.runtime
    window = backend.load_window(range(0, 1))
    kv = backend.new_kv(8, range(0, 1))
    h = backend.embed(np.array([5]))
    rt.to_device(*window.buffers["hidden"], h.astype(np.float32))
    rt.to_device(*window.buffers["positions"], np.array([0]))
    rt.to_device(*window.buffers["mask"], np.zeros((1, 1, 65), np.float32))
    past_k, past_v = kv.window(window.layers)
    inputs = [
        {"past_k": past_k, "past_v": past_v}.get(name) or window.buffers[name] for name in window.model.inputs
    ]
    outputs = [window.buffers[name] for name in window.model.outputs]
    model, mdl = window.model, cann.mdl
    out_ptr, out_bytes = window.buffers["hidden_out"]

    def datasets() -> tuple[object, object]:
        in_ds, out_ds = rt._dataset(inputs), rt._dataset(outputs)
        shaped = [name for name in model.inputs if name != "ascend_mbatch_shape_data"]
        dims = [int(d) for name in shaped for d in window.graph.shape(name, 1)]
        index, _ = mdl.get_input_index_by_name(model.desc, "ascend_mbatch_shape_data")
        assert (
            mdl.set_input_dynamic_dims(
                model.model_id, in_ds, index, {"dimCount": len(dims), "name": "", "dims": dims}
            )
            == 0
        )
        return in_ds, out_ds

    in_ds, out_ds = datasets()
    assert not _ran_during_the_device_time(cann, lambda: _ok(mdl.execute(model.model_id, in_ds, out_ds)))
    in_ds, out_ds = datasets()
    cann._resolve(out_ptr, out_bytes)[:] = bytes(out_bytes)

    def run_async() -> None:
        assert mdl.execute_async(model.model_id, in_ds, out_ds, rt.stream) == 0
        assert bytes(cann._resolve(out_ptr, out_bytes)) == bytes(out_bytes)  # not written yet
        assert cann.rt.synchronize_stream(rt.stream) == 0

    assert _ran_during_the_device_time(cann, run_async)
    assert bytes(cann._resolve(out_ptr, out_bytes)) != bytes(out_bytes)
    kv.free()
    backend.release_window(window)
    backend.close()


def test_other_threads_run_while_a_window_computes(cann: FakeAcl) -> None:
    """Through the backend: a daemon's network and prefetch threads are not held up behind the
    NPU (with acl.mdl.execute they were: the watcher ran only after the device was done)."""
    backend = AclBackend(open_model(tiny_model_path("tiny-qwen3")).weights, threads=1, ctx=64)
    window = backend.load_window(range(0, 1))
    kv = backend.new_kv(8, range(0, 1))
    h = backend.embed(np.array([5]))
    assert _ran_during_the_device_time(cann, lambda: backend.run_window(window, h, np.array([0]), kv))
    kv.free()
    backend.release_window(window)
    backend.close()


def _ok(ret: int) -> None:
    assert ret == 0
