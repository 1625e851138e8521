"""Which ARM int8 instructions the kernels use: only where both the CPU and numba's target have
them (an intrinsic the target lacks would abort LLVM), and the dots follow that choice."""

from __future__ import annotations

from pathlib import Path

import numba
import pytest

from prima.kernels import arm_features, int8_dots

CORTEX_A76_CPUINFO = """processor\t: 0
BogoMIPS\t: 48.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU part\t: 0xd0b
"""
CORTEX_A53_CPUINFO = """processor\t: 0
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid
CPU part\t: 0xd03
"""


def test_cpuinfo_features_line_says_whether_the_cpu_has_dot_products(tmp_path: Path) -> None:
    a76 = tmp_path / "a76"
    a76.write_text(CORTEX_A76_CPUINFO)
    a53 = tmp_path / "a53"
    a53.write_text(CORTEX_A53_CPUINFO)
    assert "asimddp" in arm_features.cpu_features(a76)
    assert "asimddp" not in arm_features.cpu_features(a53)
    assert "asimd" in arm_features.cpu_features(a53)


@pytest.mark.parametrize(
    ("name", "features", "expected"),
    [
        ("cortex-a76", None, True),
        ("neoverse-n1", None, True),
        ("cortex-a53", None, False),
        ("generic", None, False),  # a portable build: ARMv8.0 code
        ("cortex-a72", None, False),
        ("generic", "+neon,+dotprod", True),
        ("cortex-a76", "+neon,-dotprod", False),
    ],
)
def test_numba_target_decides_whether_sdot_can_compile(
    monkeypatch: pytest.MonkeyPatch, name: str, features: str | None, expected: bool
) -> None:
    monkeypatch.setattr(numba.config, "CPU_NAME", name)
    monkeypatch.setattr(numba.config, "CPU_FEATURES", features)
    assert arm_features.target_has_dotprod() is expected


def test_dots_follow_the_choice() -> None:
    assert int8_dots.DOTPROD == arm_features.has_dotprod()
    if not arm_features.is_aarch64():
        assert not int8_dots.DOTPROD
    assert not (int8_dots.DOTPROD and int8_dots.AVX2)
    assert int8_dots.LANES == (4 if int8_dots.DOTPROD else 8 if int8_dots.AVX2 else 16)
