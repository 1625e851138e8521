"""The cpu backend honours the Backend protocol and is found by name."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from prima.backends import get_backend
from prima.backends.base import Backend
from prima.backends.cpu import CpuBackend
from prima.errors import InputError
from tests.kernels.weights import random_qtensor, reference, relative_error


def test_get_backend_cpu_returns_cpu_backend() -> None:
    backend = get_backend("cpu", threads=1)
    assert isinstance(backend, CpuBackend)
    assert backend.name == "cpu"
    assert backend.threads == 1


def test_get_backend_unknown_name_lists_available() -> None:
    with pytest.raises(InputError, match="unknown backend 'tpu'; available: cpu"):
        get_backend("tpu")


def test_cpu_backend_rejects_zero_threads() -> None:
    with pytest.raises(ValueError, match="threads"):
        CpuBackend(threads=0)


def test_cpu_backend_defaults_to_q8_and_rejects_unknown_modes() -> None:
    assert CpuBackend(threads=1).mode == "q8"
    assert get_backend("cpu", threads=1, mode="exact").mode == "exact"
    with pytest.raises(InputError, match="unknown cpu mode 'fast'; available: q8, exact"):
        CpuBackend(mode="fast")


def test_cpu_backend_q8_matmul_is_close_to_exact() -> None:
    w = random_qtensor(GGMLQuantizationType.Q4_K, rows=9, cols=256)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    assert relative_error(CpuBackend(mode="q8").matmul(w, x), x, reference(w)) < 5e-3


def test_cpu_backend_matmul_and_get_rows() -> None:
    backend: Backend = CpuBackend(mode="exact")
    w = random_qtensor(GGMLQuantizationType.Q4_K, rows=9, cols=256)
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    assert relative_error(backend.matmul(w, x), x, reference(w)) < 1e-5
    rows = backend.get_rows(w, np.array([8, 1]))
    np.testing.assert_allclose(rows, reference(w)[[8, 1]], rtol=1e-6, atol=1e-7)
