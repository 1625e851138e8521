"""pyACL, the Python API of Huawei's CANN (`import acl`, shipped with CANN, not on PyPI), behind
the few calls the acl backend makes, with every failure turned into an AclError that says what
to do.

pyACL calls return `ret` or `(value, ret)`, 0 meaning success. The context is per thread: a
daemon loads windows on an RPC thread and runs them on its compute thread, so every call first
makes this runtime's context current on the calling thread. Host arrays are handed to pyACL by
address (`ndarray.ctypes.data`), never through acl.util.numpy_to_ptr, which needs the numpy 1.x
that CANN's pyACL was built against. The rules of pyACL this module keeps to are listed, with
their sources, in docs/backends.md. Nothing here runs on a device we have tested;
tests/backends/acl/fake_acl.py stands in for the module and enforces those rules (see
docs/orangepi.md).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prima.errors import PrimaError

log = logging.getLogger("prima.backends")

# aclrtMemcpyKind
HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2
DEVICE_TO_DEVICE = 3
MALLOC_HUGE_FIRST = 0  # aclrtMemMallocPolicy: huge pages if it can, normal pages otherwise
DDR_MEM, HBM_MEM = 0, 1  # aclrtMemAttr for get_mem_info
DYNAMIC_DIMS_INPUT = "ascend_mbatch_shape_data"  # the extra input ATC adds for --dynamic_dims
MAX_DIM_CNT = 128  # aclmdlIODims.dims: a gear's full shape, every input's dims concatenated
# aclmdlGetOutputNameByIndex for a model ATC built from ONNX: "<op name>:<edge index>:<output name>".
_OUTPUT_NAME = re.compile(r"(?P<op>.*):(?P<edge>\d+):(?P<name>[^:]+)")

# CANN's error codes (acl_base.h, rt_error_codes.h) with what the user can do about them.
OUT_OF_MEMORY = (200000, 207001, 300000)
ERRORS: dict[int, str] = {
    100000: "an invalid argument (a bug in prima's acl backend: please report it)",
    100001: "acl is not initialized",
    100002: "acl was initialized twice in this process",
    100003: "the model file is invalid; delete it from the acl cache and compile again",
    100011: "the model id is invalid (the window was already released)",
    100013: "the offline model cannot be parsed; was it compiled by another CANN version? recompile it",
    100014: "the offline model cannot be read; delete it from the acl cache and compile again",
    100017: "the model's inputs do not match what it was compiled for; recompile it",
    107001: "no such NPU device id; `npu-smi info` lists the devices",
    107002: "no NPU context is current in this thread (a bug in prima's acl backend: please report it)",
    200000: "out of NPU memory",
    207001: "out of NPU memory",
    207004: "the NPU device is not available; check `npu-smi info` and the driver",
    300000: "out of NPU memory",
    500002: "CANN's graph engine failed; see the CANN logs in ~/ascend/log",
    500003: "the NPU runtime failed; see the CANN logs in ~/ascend/log",
    500004: "the NPU driver failed; check `npu-smi info` and dmesg",
}


def output_name(reported: str) -> str:
    """The graph's name for an output from what aclmdlGetOutputNameByIndex reports: for a model
    ATC built from ONNX "<op name>:<edge index>:<output name>"; anything else as it is."""
    match = _OUTPUT_NAME.fullmatch(reported)
    return match["name"] if match else reported


class AclError(PrimaError):
    """CANN is missing or an acl call failed; the message names the call, the code and the fix."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


def describe(call: str, code: int) -> str:
    """The user's message for acl call `call` having returned `code`."""
    what = ERRORS.get(code, "see the CANN logs in ~/ascend/log")
    hint = ""
    if code in OUT_OF_MEMORY:
        hint = "; give the NPU fewer layers (plan again, or lower --ctx), or stop other NPU processes"
    return f"acl call {call} failed with code {code}: {what}{hint}"


# Tests only: `module:factory` of a stand-in for pyACL that a daemon process loads instead.
STANDIN_ENV = "PRIMA_TEST_ACL_STANDIN"


def import_acl() -> Any:
    """The pyACL module, or an AclError naming what is missing (CANN, or its environment); a
    test stand-in instead when $PRIMA_TEST_ACL_STANDIN names one (see load_standin)."""
    standin = os.environ.get(STANDIN_ENV)
    if standin:
        return load_standin(standin)
    try:
        module = importlib.import_module("acl")
    except ImportError as exc:
        home = os.environ.get("ASCEND_TOOLKIT_HOME")
        if home:
            raise AclError(
                f"cannot import pyACL (`import acl`) although ASCEND_TOOLKIT_HOME={home}: {exc}; "
                "run `source $ASCEND_TOOLKIT_HOME/set_env.sh` in this shell and check that CANN's "
                "python/site-packages matches this Python (see docs/orangepi.md)"
            ) from exc
        raise AclError(
            "the acl backend needs Huawei's CANN toolkit (pyACL, `import acl`), which is not installed "
            "or not set up in this shell: install CANN and run `source /usr/local/Ascend/ascend-toolkit/"
            "set_env.sh` (see docs/orangepi.md); the PyPI package named pyacl is unrelated"
        ) from exc
    if int(np.__version__.split(".")[0]) >= 2 and getattr(module, "STANDS_IN_FOR", None) != "acl":
        log.warning(
            "numpy %s with CANN's pyACL, which is built against numpy 1.x: if acl calls fail, "
            "install the board's extra (pip install -e '.[ascend]', numpy < 2)",
            np.__version__,
        )
    return module


def load_standin(spec: str) -> Any:
    """A stand-in for pyACL, for tests that run the acl backend in a daemon process (which cannot
    be handed an object): `spec` is `module:factory`, and the factory must declare
    `STANDS_IN_FOR = "acl"`; anything else is refused. Nothing computed through a stand-in is an
    NPU result, and the daemon says so in its log."""
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise AclError(f"${STANDIN_ENV}={spec!r}: expected module:factory naming a test stand-in for pyACL")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as exc:
        raise AclError(
            f"${STANDIN_ENV}={spec!r}: cannot load it ({exc}); unset it to use CANN's pyACL"
        ) from exc
    if getattr(factory, "STANDS_IN_FOR", None) != "acl":
        raise AclError(
            f"${STANDIN_ENV}={spec!r} does not declare STANDS_IN_FOR = 'acl'; only a test stand-in "
            "for pyACL may be loaded this way (unset it to use CANN's pyACL)"
        )
    with _OPEN_LOCK:  # one per process, as an imported module would be
        if spec not in _STANDINS:
            log.warning("acl backend on %s, a test stand-in for pyACL: no NPU computes here", spec)
            _STANDINS[spec] = factory()
        return _STANDINS[spec]


_STANDINS: dict[str, Any] = {}


@dataclass
class DeviceModel:
    """A loaded offline model: its id, description and the names and sizes (bytes, at the largest
    gear) of its inputs and outputs, in order."""

    model_id: int
    desc: Any
    inputs: tuple[str, ...]
    input_bytes: tuple[int, ...]
    outputs: tuple[str, ...]
    output_bytes: tuple[int, ...]


_OPEN: dict[tuple[int, int], AclRuntime] = {}
_OPEN_LOCK = threading.Lock()


def open_runtime(device_id: int = 0, acl: Any = None) -> AclRuntime:
    """The process's runtime for NPU `device_id`, opened on first use and shared (acl.init may
    run once per process); each open_runtime is matched by one close()."""
    module = acl if acl is not None else import_acl()
    with _OPEN_LOCK:
        runtime = _OPEN.get((id(module), device_id))
        if runtime is None or runtime.closed:
            runtime = _OPEN[(id(module), device_id)] = AclRuntime(device_id, module)
        else:
            runtime.users += 1
        return runtime


class AclRuntime:
    """One NPU device opened for this process: init, device, context; memory and models on it.
    Use open_runtime(), which shares it among the backends of a process."""

    def __init__(self, device_id: int, acl: Any) -> None:
        self.acl = acl
        self.device_id = device_id
        self.users = 1
        self._bound = threading.local()
        self._stream_lock = threading.Lock()
        self._check("init", self.acl.init())
        try:
            self._check("rt.set_device", self.acl.rt.set_device(device_id))
            self.context = self._value("rt.create_context", self.acl.rt.create_context(device_id))
            # Models run on this stream: pyACL's execute holds the GIL until the NPU is done, its
            # synchronize_stream waits without it (docs/backends.md), so the daemon's network
            # and prefetch threads run while a window computes.
            self.stream = self._value("rt.create_stream", self.acl.rt.create_stream())
        except AclError:
            self.acl.finalize()  # so that a later attempt may init again
            raise
        self._bound.context = self.context
        self.closed = False

    # -- errors --------------------------------------------------------------------------------
    def _check(self, call: str, ret: int) -> None:
        if ret != 0:
            raise AclError(describe(call, ret), ret)

    def _value(self, call: str, result: tuple[Any, ...]) -> Any:
        *values, ret = result
        self._check(call, ret)
        return values[0] if len(values) == 1 else tuple(values)

    def bind(self) -> None:
        """Make this runtime's context current on the calling thread (once per thread)."""
        if getattr(self._bound, "context", None) is not self.context:
            self._check("rt.set_context", self.acl.rt.set_context(self.context))
            self._bound.context = self.context

    # -- memory --------------------------------------------------------------------------------
    def malloc(self, n_bytes: int) -> int:
        self.bind()
        return self._value("rt.malloc", self.acl.rt.malloc(n_bytes, MALLOC_HUGE_FIRST))

    def free(self, ptr: int) -> None:
        if not self.closed:
            self.bind()
            self._check("rt.free", self.acl.rt.free(ptr))

    def zero(self, ptr: int, n_bytes: int) -> None:
        self.bind()
        self._check("rt.memset", self.acl.rt.memset(ptr, n_bytes, 0, n_bytes))

    def to_device(self, ptr: int, capacity: int, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array)
        if a.nbytes > capacity:
            raise AclError(f"{a.nbytes} bytes do not fit a device buffer of {capacity} (prima bug)")
        self.bind()
        src = a.ctypes.data  # `a` lives until memcpy returns (a synchronous copy)
        self._check("rt.memcpy", self.acl.rt.memcpy(ptr, capacity, src, a.nbytes, HOST_TO_DEVICE))

    def to_host(self, ptr: int, out: np.ndarray) -> np.ndarray:
        if not out.flags.c_contiguous:
            raise AclError("a device copy needs a contiguous host array (prima bug)")
        self.bind()
        dst = out.ctypes.data
        self._check("rt.memcpy", self.acl.rt.memcpy(dst, out.nbytes, ptr, out.nbytes, DEVICE_TO_HOST))
        return out

    def copy(self, dst: int, capacity: int, src: int, n_bytes: int) -> None:
        self.bind()
        self._check("rt.memcpy", self.acl.rt.memcpy(dst, capacity, src, n_bytes, DEVICE_TO_DEVICE))

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of device memory, the larger of its DDR and HBM pools (on the
        Atlas 200I/500 A2 class, the 310B's, an HBM query is answered from DDR, documented; that
        this DDR is the LPDDR4X the CPU shares is not verified on a device)."""
        self.bind()
        pools = [self._value("rt.get_mem_info", self.acl.rt.get_mem_info(a)) for a in (DDR_MEM, HBM_MEM)]
        return max(pools, key=lambda p: p[1])

    # -- models --------------------------------------------------------------------------------
    def load_model(self, path: Path) -> DeviceModel:
        self.bind()
        if not path.is_file():
            raise AclError(f"offline model {path} is missing; compile the window again (prima npu compile)")
        model_id = self._value("mdl.load_from_file", self.acl.mdl.load_from_file(str(path)))
        mdl = self.acl.mdl
        desc = mdl.create_desc()
        try:
            self._check("mdl.get_desc", mdl.get_desc(desc, model_id))
            n_in, n_out = mdl.get_num_inputs(desc), mdl.get_num_outputs(desc)
            return DeviceModel(
                model_id,
                desc,
                tuple(mdl.get_input_name_by_index(desc, i) for i in range(n_in)),
                tuple(mdl.get_input_size_by_index(desc, i) for i in range(n_in)),
                tuple(output_name(mdl.get_output_name_by_index(desc, i)) for i in range(n_out)),
                tuple(mdl.get_output_size_by_index(desc, i) for i in range(n_out)),
            )
        except AclError:
            mdl.destroy_desc(desc)
            mdl.unload(model_id)
            raise

    def unload(self, model: DeviceModel) -> None:
        if self.closed:
            return
        self.bind()
        self._check("mdl.unload", self.acl.mdl.unload(model.model_id))
        self._check("mdl.destroy_desc", self.acl.mdl.destroy_desc(model.desc))

    def execute(
        self,
        model: DeviceModel,
        inputs: list[tuple[int, int]],
        outputs: list[tuple[int, int]],
        dims: list[int] | None = None,
    ) -> None:
        """Run `model` on device buffers (ptr, bytes), in the model's input and output order;
        `dims` picks the gear of a model compiled with dynamic dims: the full shape of every
        input at that gear, concatenated in the model's order (at most MAX_DIM_CNT)."""
        if dims is not None and len(dims) > MAX_DIM_CNT:
            raise AclError(f"a gear of {len(dims)} dims exceeds pyACL's {MAX_DIM_CNT} (prima bug)")
        self.bind()
        mdl = self.acl.mdl
        in_ds, out_ds = self._dataset(inputs), self._dataset(outputs)
        try:
            if dims is not None:
                index = self._value(
                    "mdl.get_input_index_by_name", mdl.get_input_index_by_name(model.desc, DYNAMIC_DIMS_INPUT)
                )
                spec = {"dimCount": len(dims), "name": "", "dims": [int(d) for d in dims]}
                self._check(
                    "mdl.set_input_dynamic_dims",
                    mdl.set_input_dynamic_dims(model.model_id, in_ds, index, spec),
                )
            # One execution at a time on the stream: CANN asks callers sharing a model or a
            # stream across threads to lock around a run (aclmdlExecuteAsync's restrictions).
            with self._stream_lock:
                self._check(
                    "mdl.execute_async", mdl.execute_async(model.model_id, in_ds, out_ds, self.stream)
                )
                self._check("rt.synchronize_stream", self.acl.rt.synchronize_stream(self.stream))
        finally:  # the datasets live until the stream is synchronized
            self._destroy_dataset(in_ds)
            self._destroy_dataset(out_ds)

    def _dataset(self, buffers: list[tuple[int, int]]) -> Any:
        ds = self.acl.mdl.create_dataset()
        for ptr, size in buffers:
            buf = self.acl.create_data_buffer(ptr, size)
            _, ret = self.acl.mdl.add_dataset_buffer(ds, buf)
            if ret != 0:
                self.acl.destroy_data_buffer(buf)
                self._destroy_dataset(ds)
                self._check("mdl.add_dataset_buffer", ret)
        return ds

    def _destroy_dataset(self, ds: Any) -> None:
        for i in range(self.acl.mdl.get_dataset_num_buffers(ds)):
            self.acl.destroy_data_buffer(self.acl.mdl.get_dataset_buffer(ds, i))
        self.acl.mdl.destroy_dataset(ds)

    def close(self) -> None:
        """Give the device back once its last user closes it (models and buffers released)."""
        with _OPEN_LOCK:
            self.users -= 1
            if self.closed or self.users > 0:
                return
        self.bind()
        self.closed = True
        self._check("rt.destroy_stream", self.acl.rt.destroy_stream(self.stream))
        self._check("rt.destroy_context", self.acl.rt.destroy_context(self.context))
        self._check("rt.reset_device", self.acl.rt.reset_device(self.device_id))
        self._check("finalize", self.acl.finalize())
