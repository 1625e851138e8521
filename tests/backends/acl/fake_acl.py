"""Test doubles for CANN: FakeAcl for the pyACL module and a stand-in `atc` executable.

Neither is Huawei's software, and nothing tested through them is a hardware result. Both
enforce the documented rules of the real ones that prima depends on, each listed with its
source in docs/backends.md ("What prima relies on"), so that breaking one fails a test here:

- ATC (`--dynamic_dims`): --input_format=ND, 2 to 100 gears, one value per -1 of
  --input_shape in each, and at most 4 of them; with --host_env_os and --host_env_cpu (set
  together) the model is written as `<output>_<os>_<cpu>.om`;
- aclmdlGetOutputNameByIndex answers "<op name>:<edge index>:<output name>" for an ONNX model;
- aclmdlSetInputDynamicDims takes a gear's full shape, every input's dims concatenated, at most
  ACL_MAX_DIM_CNT (128) of them;
- memory and model calls need a context current in the calling thread (ACL_ERROR_RT_CONTEXT_NULL,
  107002, otherwise);
- aclrtGetMemInfo answers an HBM query from DDR (the Atlas 200I/500 A2 class, the 310B's) and,
  for a device that shares the host's memory (`shared_host`), from the host's memory;
- acl.util.numpy_to_ptr fails under numpy 2 (CANN's pyACL is built against numpy 1.x);
- onnxruntime runs a compiled model with its float16 roundings, as the device's float16
  MatMuls would (with_fp16_rounding; its CPU provider alone would skip them);
- acl.mdl.execute holds the GIL until the device is done (with `device_seconds` set, no other
  Python thread runs meanwhile); acl.mdl.execute_async queues the run on a stream, whose outputs
  exist once acl.rt.synchronize_stream returns, and that call waits with the GIL released.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from prima.backends.acl.atc import ACL_CACHE_ENV
from prima.backends.acl.runtime import STANDIN_ENV

SUCCESS = 0
INVALID_PARAM = 100000
UNINITIALIZE = 100001
REPEAT_INITIALIZE = 100002
INVALID_MODEL_ID = 100011
PARSE_MODEL = 100013
READ_MODEL_FAILURE = 100014
MODEL_INPUT_NOT_MATCH = 100017
MODEL_OUTPUT_NOT_MATCH = 100018
RT_INVALID_DEVICEID = 107001
RT_CONTEXT_NULL = 107002
RT_MEMORY_ALLOCATION = 207001
RT_NO_DEVICE = 207004

REPO_ROOT = Path(__file__).resolve().parents[3]
# libc through ctypes.PyDLL: its calls keep the GIL, as pyACL's execute does while the NPU computes.
_LIBC = ctypes.PyDLL(ctypes.util.find_library("c"))
DYNAMIC_DIMS_INPUT = "ascend_mbatch_shape_data"
MAX_DIM_CNT = 128  # acl_mdl.h: aclmdlIODims.dims
_SPAN = 1 << 40  # device addresses: each allocation is its own span, so base = ptr - ptr % _SPAN
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(float16)": np.float16}

# Tests only: seconds the stand-in atc takes, and a file it appends each run's output path to.
FAKE_ATC_SECONDS_ENV = "PRIMA_TEST_FAKE_ATC_SECONDS"
FAKE_ATC_LOG_ENV = "PRIMA_TEST_FAKE_ATC_LOG"

FAKE_ATC = """#!{python}
# Stand-in for CANN's atc (tests only): checks the --dynamic_dims rules ATC documents, then
# writes <output>.om (<output>_<os>_<cpu>.om with --host_env_os/--host_env_cpu) naming the ONNX
# file it stands for.
import json, os, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
for flag in ("framework", "model", "output", "soc_version", "input_shape"):
    if flag not in args:
        sys.exit("ATC_ERROR: --" + flag + " is required")
if args["framework"] != "5":
    sys.exit("ATC_ERROR: only ONNX (--framework=5) here")
if args.get("dynamic_dims"):
    if args.get("input_format") != "ND":
        sys.exit("ATC_ERROR: --dynamic_dims needs --input_format=ND")
    free = sum(part.rsplit(":", 1)[1].split(",").count("-1") for part in args["input_shape"].split(";"))
    gears = [g.split(",") for g in args["dynamic_dims"].split(";")]
    if not 2 <= len(gears) <= 100:
        sys.exit("ATC_ERROR: --dynamic_dims takes 2 to 100 gears, not %d" % len(gears))
    if any(len(g) != free for g in gears):
        sys.exit("ATC_ERROR: each gear of --dynamic_dims needs one value per -1 of --input_shape")
    if free > 4:
        sys.exit("ATC_ERROR: at most 4 dynamic dims per gear, not %d" % free)
host_os, host_cpu = args.get("host_env_os"), args.get("host_env_cpu")
if bool(host_os) != bool(host_cpu):
    sys.exit("ATC_ERROR: --host_env_os and --host_env_cpu are set together")
# With them, the model's file name carries the OS and architecture it runs on.
om = args["output"] + ("_%s_%s" % (host_os, host_cpu) if host_os else "") + ".om"
time.sleep(float(os.environ.get("{seconds_env}") or 0))
if os.environ.get("{log_env}"):
    compiler = ",".join(v + "=" + os.environ.get(v, "") for v in ("TE_PARALLEL_COMPILER", "MAX_COMPILE_CORE_NUMBER"))
    with open(os.environ["{log_env}"], "a") as log:
        log.write(args["output"] + "\\t" + compiler + "\\n")
with open(om, "w") as f:
    json.dump({{"format": "fake-om", "onnx": args["model"], "input_shape": args["input_shape"],
               "dynamic_dims": args.get("dynamic_dims", ""), "soc_version": args["soc_version"]}}, f)
"""


def write_fake_atc(bin_dir: Path) -> Path:
    """The stand-in atc written into `bin_dir` (to be put on PATH); returns `bin_dir`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "atc"
    text = FAKE_ATC.format(python=sys.executable, seconds_env=FAKE_ATC_SECONDS_ENV, log_env=FAKE_ATC_LOG_ENV)
    script.write_text(text, encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def standin_env(tmp: Path) -> dict[str, str]:
    """Environment variables under which a daemon process runs its acl backend on FakeAcl (a
    labelled stand-in: see prima.backends.acl.runtime.load_standin) with the stand-in atc."""
    bin_dir = write_fake_atc(tmp / "bin")
    return {
        STANDIN_ENV: f"{__name__}:FakeAcl",
        ACL_CACHE_ENV: str(tmp / "acl-cache"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
    }


@contextmanager
def fake_cann(tmp: Path, memory_bytes: int = 1 << 30, shared_host: bool = False) -> Iterator[FakeAcl]:
    """FakeAcl importable as `acl`, the fake atc on PATH, and the acl cache under `tmp`."""
    bin_dir = write_fake_atc(tmp / "bin")
    fake = FakeAcl(memory_bytes, shared_host=shared_host)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "acl", fake)
        mp.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        mp.setenv("PRIMA_CACHE", str(tmp / "cache"))
        yield fake


@dataclass
class _Model:
    session: Any
    inputs: list[str]  # the graph's, in order (ATC's dynamic-dims input comes after them)
    outputs: list[str]
    output_names: list[str]  # as aclmdlGetOutputNameByIndex reports them
    in_shapes: dict[str, list[int]]  # --input_shape, in its order: -1 where a gear decides
    sym_shapes: dict[str, list[int | str]]  # the ONNX graph's, symbols where it has them
    out_shapes: dict[str, list[int | str]]
    dtypes: dict[str, Any]
    gears: list[list[int]]  # --dynamic_dims: the values of the -1s
    weight_bytes: int


@dataclass
class _Dataset:
    buffers: list[tuple[int, int]] = field(default_factory=list)
    dims: list[int] | None = None


class FakeAcl:
    """Stands in for Huawei's acl module (pyACL), which cannot run without an Ascend device.

    It implements the subset of pyACL the acl backend calls, with its conventions: `ret` or
    `(value, ret)`, 0 for success and CANN's error codes otherwise. Device memory is host memory
    behind integer addresses, limited to `memory_bytes`; a loaded offline model is the fake
    ATC's .om, which names the ONNX file it was compiled from, and executing it runs that ONNX
    file with onnxruntime on the CPU. `fail(call, code)` makes the next such call return `code`.
    `shared_host`: the device's memory is the host's (as the 310B's), and get_mem_info says so.
    The rules it enforces are in the module's docstring. A daemon process loads it through
    $PRIMA_TEST_ACL_STANDIN (see `standin_env`)."""

    STANDS_IN_FOR = "acl"  # what prima.backends.acl.runtime.load_standin requires

    def __init__(self, memory_bytes: int = 1 << 30, devices: int = 1, shared_host: bool = False) -> None:
        self.memory_bytes = memory_bytes
        self.devices = devices
        self.shared_host = shared_host
        self.initialized = False
        self.device: int | None = None
        self.contexts: set[Any] = set()
        self._thread = threading.local()  # the calling thread's current context
        self.mem: dict[int, bytearray] = {}
        self.models: dict[int, _Model] = {}
        self.executions = 0
        self.streams: dict[Any, list[Callable[[], int]]] = {}
        # The device's compute time of each execution (0: none modelled), and when the last ends.
        self.device_seconds = 0.0
        self.device_until = 0.0
        self.device_started = threading.Event()  # set when the device starts computing
        self.device_idle = threading.Event()
        self._next = 1
        self._failures: dict[str, int] = {}
        self.rt = _Namespace(self, "rt")
        self.mdl = _Namespace(self, "mdl")
        self.util = _Namespace(self, "util")

    # -- test controls -------------------------------------------------------------------------
    def fail(self, call: str, code: int) -> None:
        self._failures[call] = code

    def _injected(self, call: str) -> int:
        return self._failures.pop(call, SUCCESS)

    @property
    def used_bytes(self) -> int:
        return sum(len(b) for b in self.mem.values()) + sum(m.weight_bytes for m in self.models.values())

    def _no_context(self) -> bool:
        """Whether the calling thread has no current context (the runtime's calls then fail)."""
        return getattr(self._thread, "context", None) not in self.contexts

    def _id(self) -> int:
        self._next += 1
        return self._next

    def _resolve(self, ptr: int, n: int) -> memoryview | None:
        base = ptr - ptr % _SPAN
        buf = self.mem.get(base)
        off = ptr - base
        if buf is None or off + n > len(buf):
            return None
        return memoryview(buf)[off : off + n]

    # -- acl -----------------------------------------------------------------------------------
    def init(self) -> int:
        if code := self._injected("init"):
            return code
        if self.initialized:
            return REPEAT_INITIALIZE
        self.initialized = True
        return SUCCESS

    def get_soc_name(self) -> str:
        return "Ascend310B1 (FakeAcl, a stand-in: no NPU here)"

    def finalize(self) -> int:
        if not self.initialized:
            return UNINITIALIZE
        self.initialized = False
        return SUCCESS

    def create_data_buffer(self, ptr: int, size: int) -> tuple[int, int]:
        return (ptr, size)

    def destroy_data_buffer(self, buf: tuple[int, int]) -> int:
        return SUCCESS

    # -- acl.rt --------------------------------------------------------------------------------
    def rt_set_device(self, device_id: int) -> int:
        if not self.initialized:
            return UNINITIALIZE
        if code := self._injected("rt.set_device"):
            return code
        if not 0 <= device_id < self.devices:
            return RT_INVALID_DEVICEID
        self.device = device_id
        default = ("default context", device_id)  # aclrtSetDevice binds the device's default context
        self.contexts.add(default)
        self._thread.context = default
        return SUCCESS

    def rt_reset_device(self, device_id: int) -> int:
        self.device = None
        self.contexts.clear()
        return SUCCESS

    def rt_create_context(self, device_id: int) -> tuple[Any, int]:
        if self.device != device_id:
            return None, RT_INVALID_DEVICEID
        context = ("context", self._id())
        self.contexts.add(context)
        self._thread.context = context  # bound to the creating thread
        return context, SUCCESS

    def rt_set_context(self, context: Any) -> int:
        if context not in self.contexts:
            return INVALID_PARAM
        self._thread.context = context
        return SUCCESS

    def rt_destroy_context(self, context: Any) -> int:
        if context not in self.contexts:
            return INVALID_PARAM
        self.contexts.discard(context)
        return SUCCESS

    def rt_malloc(self, size: int, policy: int) -> tuple[int, int]:
        if code := self._injected("rt.malloc"):
            return 0, code
        if self._no_context():
            return 0, RT_CONTEXT_NULL
        if size <= 0 or size >= _SPAN:
            return 0, INVALID_PARAM
        if self.used_bytes + size > self.memory_bytes:
            return 0, RT_MEMORY_ALLOCATION
        ptr = self._id() * _SPAN
        self.mem[ptr] = bytearray(os.urandom(min(size, 64)) + bytes(max(0, size - 64)))  # not zeroed
        return ptr, SUCCESS

    def rt_free(self, ptr: int) -> int:
        if self._no_context():
            return RT_CONTEXT_NULL
        return SUCCESS if self.mem.pop(ptr, None) is not None else INVALID_PARAM

    def rt_memset(self, ptr: int, max_size: int, value: int, count: int) -> int:
        if self._no_context():
            return RT_CONTEXT_NULL
        view = self._resolve(ptr, count)
        if view is None or count > max_size:
            return INVALID_PARAM
        view[:] = bytes([value]) * count
        return SUCCESS

    def rt_memcpy(self, dst: int, max_size: int, src: int, count: int, kind: int) -> int:
        if code := self._injected("rt.memcpy"):
            return code
        if self._no_context():
            return RT_CONTEXT_NULL
        if count > max_size:
            return INVALID_PARAM
        if kind == 1:  # host to device
            view = self._resolve(dst, count)
            if view is None:
                return INVALID_PARAM
            view[:] = ctypes.string_at(src, count)
        elif kind == 2:  # device to host
            view = self._resolve(src, count)
            if view is None:
                return INVALID_PARAM
            ctypes.memmove(dst, bytes(view), count)
        elif kind == 3:
            a, b = self._resolve(dst, count), self._resolve(src, count)
            if a is None or b is None:
                return INVALID_PARAM
            a[:] = bytes(b)
        else:
            return INVALID_PARAM
        return SUCCESS

    def rt_get_mem_info(self, attr: int) -> tuple[int, int, int]:
        if code := self._injected("rt.get_mem_info"):
            return 0, 0, code
        if self._no_context():
            return 0, 0, RT_CONTEXT_NULL
        if attr not in (0, 1):  # ACL_DDR_MEM; ACL_HBM_MEM, answered from DDR on the 310B class
            return 0, 0, SUCCESS
        if self.shared_host:  # the device's DDR is the host's memory
            host = psutil.virtual_memory()
            return host.available, host.total, SUCCESS
        return self.memory_bytes - self.used_bytes, self.memory_bytes, SUCCESS

    # -- acl.util ------------------------------------------------------------------------------
    def util_numpy_to_ptr(self, array: np.ndarray) -> int:
        """CANN's pyACL is built against numpy 1.x, and this call imports numpy's C API."""
        if int(np.__version__.split(".")[0]) >= 2:
            raise ImportError(
                "stand-in for pyACL: acl.util.numpy_to_ptr calls numpy's import_array, and CANN's "
                f"pyACL is built against numpy 1.x, not {np.__version__}"
            )
        return int(array.ctypes.data)

    # -- acl.mdl -------------------------------------------------------------------------------
    def mdl_load_from_file(self, path: str) -> tuple[int, int]:
        if not self.initialized or self.device is None:
            return 0, UNINITIALIZE
        if code := self._injected("mdl.load_from_file"):
            return 0, code
        if self._no_context():
            return 0, RT_CONTEXT_NULL
        try:
            om = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError:
            return 0, READ_MODEL_FAILURE
        except ValueError:
            return 0, PARSE_MODEL
        if om.get("format") != "fake-om":
            return 0, PARSE_MODEL
        import onnx
        import onnxruntime as ort

        onnx_path = Path(om["onnx"])
        weight_bytes = sum(p.stat().st_size for p in onnx_path.parent.glob(onnx_path.name + "*"))
        if self.used_bytes + weight_bytes > self.memory_bytes:
            return 0, RT_MEMORY_ALLOCATION
        graph = onnx.load(str(onnx_path), load_external_data=False)
        rounded = onnx_path.with_name(onnx_path.stem + ".fake-fp16.onnx")  # beside its weights file
        onnx.save_model(with_fp16_rounding(graph), rounded)
        session = ort.InferenceSession(str(rounded), providers=["CPUExecutionProvider"])
        shapes = {}
        for part in om["input_shape"].split(";"):
            name, dims = part.rsplit(":", 1)
            shapes[name] = [int(d) for d in dims.split(",")]
        gears = [[int(d) for d in g.split(",")] for g in om["dynamic_dims"].split(";") if g]
        inputs = [i.name for i in session.get_inputs()]
        if set(shapes) != set(inputs):
            return 0, PARSE_MODEL  # real ATC would have refused the input_shape
        # aclmdlGetOutputNameByIndex, ONNX model built by ATC: "<op name>:<edge index>:<output name>".
        producers = {
            out: f"{node.name}:{edge}:{out}"
            for node in graph.graph.node
            for edge, out in enumerate(node.output)
        }
        outputs = [o.name for o in session.get_outputs()]
        model = _Model(
            session,
            inputs,
            outputs,
            [producers[o] for o in outputs],
            shapes,
            {i.name: list(i.shape) for i in session.get_inputs()},
            {o.name: list(o.shape) for o in session.get_outputs()},
            {i.name: _ORT_TYPES[i.type] for i in (*session.get_inputs(), *session.get_outputs())},
            gears,
            weight_bytes,
        )
        model_id = self._id()
        self.models[model_id] = model
        return model_id, SUCCESS

    def mdl_unload(self, model_id: int) -> int:
        if self._no_context():
            return RT_CONTEXT_NULL
        return SUCCESS if self.models.pop(model_id, None) is not None else INVALID_MODEL_ID

    def mdl_create_desc(self) -> dict[str, Any]:
        return {}

    def mdl_get_desc(self, desc: dict[str, Any], model_id: int) -> int:
        model = self.models.get(model_id)
        if model is None:
            return INVALID_MODEL_ID
        desc["model"] = model
        return SUCCESS

    def mdl_destroy_desc(self, desc: dict[str, Any]) -> int:
        desc.clear()
        return SUCCESS

    def mdl_get_num_inputs(self, desc: dict[str, Any]) -> int:
        return len(desc["model"].inputs) + 1

    def mdl_get_num_outputs(self, desc: dict[str, Any]) -> int:
        return len(desc["model"].outputs)

    def mdl_get_input_name_by_index(self, desc: dict[str, Any], i: int) -> str:
        return [*desc["model"].inputs, DYNAMIC_DIMS_INPUT][i]

    def mdl_get_output_name_by_index(self, desc: dict[str, Any], i: int) -> str:
        return desc["model"].output_names[i]

    def mdl_get_input_dynamic_gear_count(self, desc: dict[str, Any], index: int) -> tuple[int, int]:
        return len(desc["model"].gears), SUCCESS

    def mdl_get_input_dynamic_dims(
        self, desc: dict[str, Any], index: int, gear_count: int
    ) -> tuple[list[dict[str, Any]], int]:
        model: _Model = desc["model"]
        if gear_count != len(model.gears):
            return [], INVALID_PARAM
        dims = [self._full_dims(model, g) for g in model.gears]
        return [{"name": "", "dimCount": len(d), "dims": d} for d in dims], SUCCESS

    def mdl_get_input_index_by_name(self, desc: dict[str, Any], name: str) -> tuple[int, int]:
        names = [*desc["model"].inputs, DYNAMIC_DIMS_INPUT]
        return (names.index(name), SUCCESS) if name in names else (0, INVALID_PARAM)

    def mdl_get_input_size_by_index(self, desc: dict[str, Any], i: int) -> int:
        model: _Model = desc["model"]
        if i == len(model.inputs):
            return 8 * len(model.gears[0])
        return max(self._nbytes(model, model.inputs[i], g) for g in model.gears)

    def mdl_get_output_size_by_index(self, desc: dict[str, Any], i: int) -> int:
        model: _Model = desc["model"]
        return max(self._nbytes(model, model.outputs[i], g) for g in model.gears)

    def mdl_create_dataset(self) -> _Dataset:
        return _Dataset()

    def mdl_add_dataset_buffer(self, ds: _Dataset, buf: tuple[int, int]) -> tuple[_Dataset, int]:
        ds.buffers.append(buf)
        return ds, SUCCESS

    def mdl_get_dataset_num_buffers(self, ds: _Dataset) -> int:
        return len(ds.buffers)

    def mdl_get_dataset_buffer(self, ds: _Dataset, i: int) -> tuple[int, int]:
        return ds.buffers[i]

    def mdl_destroy_dataset(self, ds: _Dataset) -> int:
        return SUCCESS

    def mdl_set_input_dynamic_dims(
        self, model_id: int, ds: _Dataset, index: int, dims: dict[str, Any]
    ) -> int:
        """`dims` is a gear's full shape: every input's dims concatenated, the gear's values in
        place of the -1s, at most MAX_DIM_CNT (pyACL copies them into a fixed array)."""
        model = self.models.get(model_id)
        if model is None:
            return INVALID_MODEL_ID
        values = [int(d) for d in dims["dims"]]
        if dims["dimCount"] != len(values) or len(values) > MAX_DIM_CNT:
            return INVALID_PARAM
        if index != len(model.inputs):  # ATC's dynamic-dims input, after the graph's
            return INVALID_PARAM
        for gear in model.gears:
            if self._full_dims(model, gear) == values:
                ds.dims = gear
                return SUCCESS
        return INVALID_PARAM

    def mdl_execute(self, model_id: int, in_ds: _Dataset, out_ds: _Dataset) -> int:
        """Synchronous: returns when the device is done, and pyACL holds the GIL all the while
        (no other Python thread runs for `device_seconds`)."""
        if code := self._injected("mdl.execute"):
            return code
        if self._no_context():
            return RT_CONTEXT_NULL
        run, code = self._prepare(model_id, in_ds, out_ds)
        if run is None:
            return code
        code = run()
        self._device_busy(hold_gil=True)
        return code

    def mdl_execute_async(self, model_id: int, in_ds: _Dataset, out_ds: _Dataset, stream: Any) -> int:
        """Queued on `stream`: the outputs are written by the time synchronize_stream returns, not
        before; the datasets must live until then."""
        if code := self._injected("mdl.execute_async"):
            return code
        if self._no_context():
            return RT_CONTEXT_NULL
        if stream not in self.streams:
            return INVALID_PARAM
        run, code = self._prepare(model_id, in_ds, out_ds)
        if run is None:
            return code
        self.streams[stream].append(run)
        self._device_busy(hold_gil=False)
        return SUCCESS

    def rt_create_stream(self) -> tuple[Any, int]:
        if self._no_context():
            return None, RT_CONTEXT_NULL
        stream = ("stream", self._id())
        self.streams[stream] = []
        return stream, SUCCESS

    def rt_destroy_stream(self, stream: Any) -> int:
        if self._no_context():
            return RT_CONTEXT_NULL
        return SUCCESS if self.streams.pop(stream, None) is not None else INVALID_PARAM

    def rt_synchronize_stream(self, stream: Any) -> int:
        """Runs what `stream` holds and waits for the device with the GIL released, as pyACL's
        wrapper does (PyEval_SaveThread around aclrtSynchronizeStream)."""
        if self._no_context():
            return RT_CONTEXT_NULL
        if stream not in self.streams:
            return INVALID_PARAM
        queued, self.streams[stream] = self.streams[stream], []
        codes = [run() for run in queued]
        if code := self._injected("rt.synchronize_stream"):  # a run that failed on the device
            return code
        time.sleep(max(0.0, self.device_until - time.perf_counter()))  # releases the GIL
        self.device_idle.set()
        return next((c for c in codes if c != SUCCESS), SUCCESS)

    def device_computing(self) -> bool:
        """Whether the device is still computing what it was last given (`device_seconds`)."""
        return time.perf_counter() < self.device_until

    def _device_busy(self, hold_gil: bool) -> None:
        """The device computes for `device_seconds` from now; holding the GIL the while if
        `hold_gil` (libc's usleep called through ctypes.PyDLL, which keeps the GIL)."""
        if self.device_seconds <= 0:
            return
        self.device_until = time.perf_counter() + self.device_seconds
        self.device_idle.clear()
        self.device_started.set()
        if hold_gil:
            _LIBC.usleep(int(self.device_seconds * 1e6))
            self.device_idle.set()

    def _prepare(
        self, model_id: int, in_ds: _Dataset, out_ds: _Dataset
    ) -> tuple[Callable[[], int] | None, int]:
        """The execution of `model_id` on the datasets, checked (None and the code otherwise)."""
        model = self.models.get(model_id)
        if model is None:
            return None, INVALID_MODEL_ID
        if len(in_ds.buffers) != len(model.inputs) + 1 or in_ds.dims is None:
            return None, MODEL_INPUT_NOT_MATCH
        if len(out_ds.buffers) != len(model.outputs):
            return None, MODEL_OUTPUT_NOT_MATCH
        inputs, outputs, dims = list(in_ds.buffers), list(out_ds.buffers), list(in_ds.dims)
        return (lambda: self._run(model, inputs, outputs, dims)), SUCCESS

    def _run(
        self, model: _Model, inputs: list[tuple[int, int]], outputs: list[tuple[int, int]], gear: list[int]
    ) -> int:
        feed = {}
        shapes = self._shapes(model, gear)
        for name, (ptr, size) in zip(model.inputs, inputs, strict=False):
            shape = shapes[name]
            n = int(np.prod(shape)) * np.dtype(model.dtypes[name]).itemsize
            view = self._resolve(ptr, n)
            if view is None or n > size:
                return MODEL_INPUT_NOT_MATCH
            feed[name] = np.frombuffer(bytes(view), dtype=model.dtypes[name]).reshape(shape)
        results = model.session.run(model.outputs, feed)
        for (ptr, size), value in zip(outputs, results, strict=True):
            data = np.ascontiguousarray(value).tobytes()
            view = self._resolve(ptr, len(data))
            if view is None or len(data) > size:
                return MODEL_OUTPUT_NOT_MATCH
            view[:] = data
        self.executions += 1
        return SUCCESS

    # -- shapes --------------------------------------------------------------------------------
    def _full_dims(self, model: _Model, gear: list[int]) -> list[int]:
        """The gear's full shape as aclmdlGetInputDynamicDims reports it: every input's dims in
        the model's order, concatenated."""
        shapes = self._shapes(model, gear)
        return [d for name in model.inputs for d in shapes[name]]

    def _shapes(self, model: _Model, gear: list[int]) -> dict[str, list[int]]:
        """Every input's and output's shape at `gear`: the gear's values fill the -1s of
        --input_shape in its order (ATC's --dynamic_dims), and the ONNX graph's symbolic dims
        follow from them."""
        values = iter(gear)
        symbols: dict[str, int] = {}
        shapes: dict[str, list[int]] = {}
        for name, dims in model.in_shapes.items():
            shape = []
            for sym, dim in zip(model.sym_shapes[name], dims, strict=True):
                shape.append(next(values) if dim == -1 else dim)
                if isinstance(sym, str):
                    symbols[sym] = shape[-1]
            shapes[name] = shape
        for name, dims in model.out_shapes.items():
            shapes[name] = [symbols[d] if isinstance(d, str) else int(d) for d in dims]
        return shapes

    def _nbytes(self, model: _Model, name: str, gear: list[int]) -> int:
        return int(np.prod(self._shapes(model, gear)[name])) * np.dtype(model.dtypes[name]).itemsize


def with_fp16_rounding(model: Any) -> Any:
    """`model` with its float16 roundings made explicit, so that onnxruntime computes as a device
    with float16 MatMuls does. Its CPU provider has no float16 MatMul on x86: it casts the inputs
    to float32 and drops the Cast pairs this leaves (f32 -> f16 -> f32), so without this the
    activations would never be rounded and a graph's fp16 arithmetic would go untested. Each
    float32 -> float16 Cast is preceded, and each float16 MatMul's Cast back to float32 followed,
    by a rounding to float16 written in float32 ops: round to an 11-bit significand (Veltkamp's
    split, exact for normal halves), infinity past 65504; halves' subnormals are not modelled."""
    import onnx
    from onnx import TensorProto, helper

    inferred = onnx.shape_inference.infer_shapes(model)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)
    }
    types.update({t.name: t.data_type for t in model.graph.initializer})
    producer = {out: node.op_type for node in model.graph.node for out in node.output}
    consts = [
        helper.make_tensor("fp16_split", TensorProto.FLOAT, [], [8193.0]),  # 2^13 + 1
        helper.make_tensor("fp16_max", TensorProto.FLOAT, [], [65504.0]),
        helper.make_tensor("fp16_inf", TensorProto.FLOAT, [], [float("inf")]),
    ]
    nodes: list[Any] = []
    done: set[str] = set()

    def rounded(x: str, out: str) -> None:
        c, d, r, a, big, r_inf = (f"{out}.fp16_{k}" for k in ("c", "d", "r", "a", "big", "inf"))
        nodes.extend(
            [
                helper.make_node("Mul", [x, "fp16_split"], [c]),
                helper.make_node("Sub", [c, x], [d]),
                helper.make_node("Sub", [c, d], [r]),
                helper.make_node("Abs", [r], [a]),
                helper.make_node("Greater", [a, "fp16_max"], [big]),
                helper.make_node("Mul", [r, "fp16_inf"], [r_inf]),
                helper.make_node("Where", [big, r_inf, r], [out]),
            ]
        )

    for node in model.graph.node:
        to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None
        source = node.input[0] if node.input else ""
        if to == TensorProto.FLOAT16 and types.get(source) == TensorProto.FLOAT:
            if f"{source}.fp16" not in done:  # a tensor cast for several MatMuls is rounded once
                rounded(source, f"{source}.fp16")
                done.add(f"{source}.fp16")
            node.input[0] = f"{source}.fp16"
            nodes.append(node)
        elif (
            to == TensorProto.FLOAT
            and types.get(source) == TensorProto.FLOAT16
            and producer.get(source) == "MatMul"
        ):
            out = node.output[0]
            node.output[0] = f"{out}.unrounded"
            nodes.append(node)
            rounded(node.output[0], out)
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(consts)
    return model


class _Namespace:
    """acl.rt, acl.mdl, acl.util: the fake's `<prefix>_<name>` methods under pyACL's names."""

    def __init__(self, fake: FakeAcl, prefix: str) -> None:
        self._fake = fake
        self._prefix = prefix

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fake, f"{self._prefix}_{name}")
