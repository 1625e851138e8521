"""Compiling a window for the NPU: its ONNX graph (onnx_window) exported once, then ATC, CANN's
offline model compiler, run on it; both cached per model fingerprint, window, context size,
gears, SoC, CANN version and the OS and CPU that run it, so a window is compiled once, before a
daemon serves, and loaded at every plan.

The command line (`AtcJob.argv`), with the flags ascend-llm and qwen-ascend-llm use on the 310B:

  atc --framework=5 --model=window.onnx --output=window --soc_version=Ascend310B1
      --input_format=ND
      --input_shape="hidden:-1,576;positions:-1;mask:1,-1,-1;past_k:30,512,3,64;past_v:30,512,3,64"
      --dynamic_dims="1,1,1,513;2,2,2,514;4,4,4,516;8,8,8,520"
      --precision_mode=must_keep_origin_dtype --log=error

--framework=5 is ONNX; every -1 is the token count n or the key count ctx + n, one value each
per gear (the prefill lengths the model accepts); must_keep_origin_dtype keeps the graph's own
mix (fp16 MatMuls, fp32 norms and softmax) instead of letting ATC cast the norms' squares to
fp16. The rules this keeps to (2-100 gears, at most 4 dynamic dims per gear, at most 128 dims
in a gear's full shape) are in docs/backends.md with their sources. Nothing here has been run
against a real ATC; the tests check the command lines and run a stand-in ATC
(tests/backends/acl/fake_acl.py) that enforces those rules.
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from prima.backends.acl.onnx_window import WindowGraph, window_graph
from prima.backends.acl.runtime import MAX_DIM_CNT, AclError
from prima.errors import InputError
from prima.model.config import ModelConfig
from prima.model.weights import ModelWeights
from prima.paths import cache_root

log = logging.getLogger("prima.backends")

DEFAULT_SOC = "Ascend310B1"  # the OrangePi AIpro's NPU
DEFAULT_GEARS: tuple[int, ...] = (1, 2, 4, 8)  # tokens per call: decode, and prefill in chunks
PRECISION_FLAGS: tuple[str, ...] = ("--precision_mode=must_keep_origin_dtype",)
# Bumped whenever onnx_window builds a different graph, so cached models are rebuilt.
GRAPH_VERSION = 4  # 2: KV dtype chosen; 3: KV packed per window, masks stacked; 4: f16 attention
DEFAULT_KV_DTYPE = "float16"
# ATC's --dynamic_dims: 2 to 100 gears, at most 4 dynamic dims in each (docs/backends.md).
GEAR_COUNT = range(2, 101)
MAX_DYNAMIC_DIMS = 4
# ATC's parallel operator compiles (8 processes by default) exhaust a board's RAM; Huawei's board
# samples set one process and one core below 8 GB. Below this much RAM prima does the same (a
# wider margin: a language model's window is a larger graph), unless the environment sets them
# (docs/backends.md).
SMALL_BOARD_RAM_BYTES = 32 << 30
SMALL_BOARD_ATC_ENV: Mapping[str, str] = {"TE_PARALLEL_COMPILER": "1", "MAX_COMPILE_CORE_NUMBER": "1"}


@dataclass(frozen=True)
class HostEnv:
    """The OS and CPU of the machine that will run a compiled model (ATC's --host_env_os and
    --host_env_cpu), e.g. linux/aarch64 for a board when compiling on an x86 laptop."""

    os: str
    cpu: str

    @classmethod
    def this_machine(cls) -> HostEnv:
        return cls(platform.system().lower(), platform.machine())

    @property
    def key(self) -> str:
        return f"{self.os}-{self.cpu}"


@dataclass(frozen=True)
class AtcJob:
    """One ATC run: the ONNX file of a window compiled into `<output>.om`."""

    onnx: Path
    output: Path  # without the .om ATC appends
    soc_version: str
    input_shape: str
    dynamic_dims: str
    precision: tuple[str, ...] = PRECISION_FLAGS
    host_env: HostEnv | None = None  # None: the machine ATC runs on runs the model

    @property
    def om(self) -> Path:
        return self.output.with_name(self.output.name + ".om")

    def produced(self) -> Path | None:
        """The model ATC wrote: `<output>.om`, or `<output>_<os>_<arch>.om` when it names the
        OS and architecture the model runs on (it may, with --host_env_os/--host_env_cpu)."""
        if self.om.is_file():
            return self.om
        named = sorted(self.output.parent.glob(self.output.name + "_*.om"))
        return named[0] if len(named) == 1 else None

    def argv(self, atc: str = "atc") -> list[str]:
        return [
            atc,
            "--framework=5",
            f"--model={self.onnx}",
            f"--output={self.output}",
            f"--soc_version={self.soc_version}",
            "--input_format=ND",
            f"--input_shape={self.input_shape}",
            f"--dynamic_dims={self.dynamic_dims}",
            *self.precision,
            *(
                (f"--host_env_os={self.host_env.os}", f"--host_env_cpu={self.host_env.cpu}")
                if self.host_env
                else ()
            ),
            "--log=error",
        ]


def shapes(cfg: ModelConfig, layers: range, ctx: int, gears: Sequence[int]) -> tuple[str, str]:
    """ATC's --input_shape and --dynamic_dims for a window graph: n and ctx + n are the -1s."""
    check_gears(gears)
    graph = window_graph(cfg, layers, ctx)
    symbolic = [graph.shape(name, "n") for name in graph.inputs]
    input_shape = ";".join(
        f"{name}:" + ",".join("-1" if isinstance(d, str) else str(d) for d in dims)
        for name, dims in zip(graph.inputs, symbolic, strict=True)
    )
    gear_dims = []
    for n in gears:
        values = [
            d
            for sym, dims in zip(symbolic, (graph.shape(name, n) for name in graph.inputs), strict=True)
            for s, d in zip(sym, dims, strict=True)
            if isinstance(s, str)
        ]
        # Internal invariants: the graph is built to keep within ATC's and the runtime's limits.
        assert len(values) <= MAX_DYNAMIC_DIMS, values
        assert len(full_dims(graph, graph.inputs, n)) <= MAX_DIM_CNT
        gear_dims.append(values)
    return input_shape, ";".join(",".join(map(str, g)) for g in gear_dims)


def check_gears(gears: Sequence[int]) -> None:
    """ATC compiles 2 to 100 gears (--dynamic_dims); an InputError otherwise."""
    if len(set(gears)) not in GEAR_COUNT:
        raise InputError(
            f"gears {','.join(map(str, gears))}: ATC compiles {GEAR_COUNT.start} to {GEAR_COUNT.stop - 1} "
            "distinct gears (tokens per call), e.g. 1,2,4,8"
        )


def full_dims(graph: WindowGraph, inputs: Sequence[str], n: int) -> list[int]:
    """What pyACL's set_input_dynamic_dims takes for the gear of n tokens: the full shape of every
    input in `inputs` (the model's order, without ATC's own dynamic-dims input), concatenated."""
    return [int(d) for name in inputs for d in graph.shape(name, n)]


def cann_version() -> str:
    """The installed CANN toolkit's version, read from where set_env.sh points ('none' without it):
    the toolkit directory's resolved name (…/ascend-toolkit/latest -> 7.0.0)."""
    home = os.environ.get("ASCEND_TOOLKIT_HOME")
    return Path(home).resolve().name if home else "none"


def find_atc() -> str:
    """The atc executable on PATH, or an AclError saying how to get it."""
    atc = shutil.which("atc")
    if atc is None:
        raise AclError(
            "ATC (CANN's model compiler) is not on PATH: install the CANN toolkit and run "
            "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` (see docs/orangepi.md), or compile "
            "the windows on another machine with `prima npu compile` and copy the acl cache"
        )
    return atc


def atc_environment(base: Mapping[str, str], total_ram_bytes: int) -> dict[str, str]:
    """The environment ATC runs in: `base`, and on a machine with less than
    SMALL_BOARD_RAM_BYTES of RAM one compiler process on one core, unless `base` says otherwise."""
    env = dict(base)
    if total_ram_bytes < SMALL_BOARD_RAM_BYTES:
        for name, value in SMALL_BOARD_ATC_ENV.items():
            env.setdefault(name, value)
    return env


@dataclass(frozen=True)
class WindowArtifacts:
    """Where a window's ONNX graph and offline model are cached, and the ATC run that makes one."""

    directory: Path
    job: AtcJob
    kv_dtype: str = DEFAULT_KV_DTYPE

    @property
    def onnx(self) -> Path:
        return self.job.onnx

    @property
    def om(self) -> Path:
        return self.job.om


ACL_CACHE_ENV = "PRIMA_ACL_CACHE"


def acl_cache_dir() -> Path:
    """`$PRIMA_ACL_CACHE` (e.g. a larger disk, or a cache compiled on another machine), else
    `<prima cache>/acl`."""
    explicit = os.environ.get(ACL_CACHE_ENV)
    return Path(explicit).expanduser() if explicit else cache_root() / "acl"


def artifacts(
    weights: ModelWeights,
    fingerprint: str,
    layers: range,
    ctx: int,
    gears: Sequence[int] = DEFAULT_GEARS,
    soc: str = DEFAULT_SOC,
    root: Path | None = None,
    kv_dtype: str = DEFAULT_KV_DTYPE,
    host_env: HostEnv | None = None,
) -> WindowArtifacts:
    """The cache entry of one window with a `kv_dtype` KV cache, for a model run on `host_env`
    (None: this machine), keyed on everything that changes the offline model: the model file,
    SoC, CANN version, the host's OS and CPU, the graph's version, layers, context, gears and KV
    dtype (nothing is written)."""
    runs_on = host_env or HostEnv.this_machine()
    gear_key = "_".join(map(str, gears))
    key = f"g{GRAPH_VERSION}-{layers.start}-{layers.stop}-ctx{ctx}-gears{gear_key}-kv{kv_dtype}"
    target = f"{soc}-cann{cann_version()}-{runs_on.key}"
    directory = (root or acl_cache_dir()) / fingerprint / target / key
    input_shape, dynamic_dims = shapes(weights.config, layers, ctx, gears)
    job = AtcJob(
        directory / "window.onnx", directory / "window", soc, input_shape, dynamic_dims, host_env=host_env
    )
    return WindowArtifacts(directory, job, kv_dtype)


def export(weights: ModelWeights, art: WindowArtifacts, layers: range, ctx: int) -> None:
    """Write the window's ONNX graph (weights in a side file: ONNX files stop at 2 GB)."""
    import onnx

    from prima.backends.acl.onnx_window import export_window

    art.directory.mkdir(parents=True, exist_ok=True)
    model = export_window(weights, layers, ctx, art.kv_dtype)
    tmp = art.onnx.with_name("window.tmp.onnx")
    onnx.save_model(model, tmp, save_as_external_data=True, location="window.onnx.data", size_threshold=1024)
    tmp.replace(art.onnx)


def compile_window(
    weights: ModelWeights,
    art: WindowArtifacts,
    layers: range,
    ctx: int,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The window's offline model, exported and compiled unless the cache has it."""
    say = progress or log.info
    if art.om.is_file():
        return art.om
    if not art.onnx.is_file():
        say(f"exporting layers {layers.start}-{layers.stop - 1} to ONNX ({art.onnx})")
        export(weights, art, layers, ctx)
    argv = art.job.argv(find_atc())
    say(f"compiling layers {layers.start}-{layers.stop - 1} with ATC (minutes on the board)")
    (art.directory / "atc.cmd").write_text(shlex.join(argv) + "\n", encoding="utf-8")
    env = atc_environment(os.environ, psutil.virtual_memory().total)
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    produced = art.job.produced() if proc.returncode == 0 else None
    if produced is not None and produced != art.om:
        produced.replace(art.om)  # one name in the cache, whatever ATC called it
    if produced is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise AclError(
            f"ATC failed to compile layers {layers.start}-{layers.stop - 1} (exit {proc.returncode}): "
            + " | ".join(tail)
            + f"; the command is in {art.directory / 'atc.cmd'}"
        )
    return art.om
