"""Which of ARM's optional int8 instructions the kernels may use here: the CPU must have them, and
numba must compile for a target that LLVM knows has them (an intrinsic the target lacks is a
fatal LLVM error, not an exception).

The CPU's side comes from Linux: /proc/cpuinfo's "Features" line ("asimddp": ARMv8.2's
sdot/udot), else the kernel's hardware capability bits (getauxval(AT_HWCAP)), which /proc/cpuinfo
prints and qemu-user emulates for its CPU model (qemu-user shows guests the host's /proc/cpuinfo).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numba
from llvmlite import binding as llvm

log = logging.getLogger("prima.kernels")

# Linux's AArch64 HWCAP bit for FEAT_DotProd (arch/arm64/include/uapi/asm/hwcap.h: HWCAP_ASIMDDP).
_AT_HWCAP = 16
_HWCAP_ASIMDDP = 1 << 20

# LLVM CPU names (NUMBA_CPU_NAME) whose default features include dotprod: ARMv8.2+ cores with
# FEAT_DotProd. A name not listed gets the ARMv8.0 kernels: correct everywhere, only slower.
_DOTPROD_CPUS = frozenset(
    {
        "cortex-a55", "cortex-a65", "cortex-a75", "cortex-a76", "cortex-a76ae", "cortex-a77",
        "cortex-a78", "cortex-a78c", "cortex-a510", "cortex-a710", "cortex-a715", "cortex-x1",
        "cortex-x2", "cortex-x3", "neoverse-n1", "neoverse-n2", "neoverse-v1", "neoverse-v2",
        "apple-m1", "apple-m2", "apple-m3", "ampere1",
    }
)  # fmt: skip


def is_aarch64() -> bool:
    triple = llvm.get_default_triple()
    return triple.startswith(("aarch64", "arm64"))


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The Linux feature names of this CPU ("asimd", "asimddp", ...); empty where unknown."""
    try:
        with cpuinfo.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "Features":
                    return set(value.split())
    except OSError:
        pass
    try:
        hwcap = ctypes.CDLL(None).getauxval(_AT_HWCAP)
    except (OSError, AttributeError):  # no getauxval (not glibc/bionic/musl)
        return set()
    return {"asimddp"} if hwcap & _HWCAP_ASIMDDP else set()


def target_has_dotprod() -> bool:
    """True when numba's target includes FEAT_DotProd: NUMBA_CPU_FEATURES naming +dotprod, a
    NUMBA_CPU_NAME known to have it, or the host target with LLVM's host features saying so."""
    if numba.config.CPU_FEATURES:
        return "+dotprod" in numba.config.CPU_FEATURES.split(",")
    name = numba.config.CPU_NAME
    if name and name != "host":
        return name in _DOTPROD_CPUS
    return bool(llvm.get_host_cpu_features().get("dotprod"))


def has_dotprod() -> bool:
    """sdot/udot may be used: an AArch64 CPU with them and a numba target that has them."""
    if not is_aarch64():
        return False
    cpu = "asimddp" in cpu_features()
    target = target_has_dotprod()
    if cpu != target:
        log.debug("int8 dot products: cpu %s, numba target %s; using the ARMv8.0 kernels", cpu, target)
    return cpu and target
