"""primad --threads reaches the threads that compute: numba's count is per calling thread."""

from __future__ import annotations

import threading

import pytest

from prima.daemon.threads import use_threads


def test_use_threads_sets_the_count_in_the_calling_thread_only() -> None:
    numba = pytest.importorskip("numba")
    before = numba.get_num_threads()
    seen: list[int] = []

    def work() -> None:
        use_threads(1)
        seen.append(numba.get_num_threads())

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=30)
    assert seen == [1]
    assert numba.get_num_threads() == before
    use_threads(None)  # no --threads: nothing changes
    assert numba.get_num_threads() == before
