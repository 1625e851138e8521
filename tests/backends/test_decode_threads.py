"""DecodeThreads, driven by scripted step times: it keeps the fastest count on a quiet machine
without flapping, moves to fewer threads soon after another process takes a core, and back once
the core is free again."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prima.backends import decode_threads
from prima.backends.decode_threads import (
    LONGEST_GAP_S,
    LONGEST_INTERVAL,
    DecodeThreads,
    adaptive_by_default,
    thread_options,
)

# ms per step by thread count, as measured on a 2-core AMD EPYC with SmolLM2 (quiet: two threads
# win; one core kept busy by another process: one thread wins by far).
QUIET = {2: 5.2, 1: 7.5}
BUSY = {2: 15.0, 1: 7.4}

StepTimes = Callable[[int, int], float]  # (step, threads) -> ms


def run(chooser: DecodeThreads, steps: int, ms: StepTimes, first: int = 0) -> list[int]:
    """The counts used by steps first..first+steps-1."""
    used = []
    for step in range(first, first + steps):
        n = chooser.next_threads()
        chooser.record(n, ms(step, n))
        used.append(n)
    return used


def test_options_are_all_half_and_one_thread() -> None:
    assert thread_options(8) == (8, 4, 1)
    assert thread_options(2) == (2, 1)
    assert thread_options(1) == (1,)


def test_quiet_machine_keeps_all_threads_and_probes_ever_more_rarely() -> None:
    chooser = DecodeThreads(2)
    used = run(chooser, 4000, lambda step, n: QUIET[n])
    assert chooser.current == 2
    assert chooser.switches == 0
    one_thread_steps = [i for i, n in enumerate(used) if n == 1]
    assert one_thread_steps, "it never tried one thread"
    # Probes get rarer: few single-thread steps in the last stretch, at most one probe's worth.
    assert sum(1 for i in one_thread_steps if i >= 3000) <= decode_threads.PROBE_STEPS * 3
    assert len(one_thread_steps) / len(used) < 0.03


def test_a_busy_core_moves_decode_to_one_thread_within_a_few_dozen_steps() -> None:
    chooser = DecodeThreads(2)
    run(chooser, 3000, lambda step, n: QUIET[n])
    assert chooser.current == 2
    used = run(chooser, 200, lambda step, n: BUSY[n], first=3000)
    first_switch = used.index(1)
    assert chooser.current == 1
    assert first_switch < 20  # the jump in step time brings the probe forward
    after = used[first_switch:]
    assert after.count(2) <= 0.1 * len(after)  # probes, rarer each time one thread wins again


def test_a_freed_core_brings_all_threads_back() -> None:
    chooser = DecodeThreads(2)
    run(chooser, 500, lambda step, n: BUSY[n])
    assert chooser.current == 1
    # One thread runs at the same speed either way, so nothing in its own steps shows the
    # change: the periodic probe finds it, within the longest interval between probes.
    used = run(chooser, LONGEST_INTERVAL + 100, lambda step, n: QUIET[n], first=500)
    assert chooser.current == 2
    assert used[-50:].count(2) >= 50 - decode_threads.PROBE_STEPS


def test_slow_steps_are_probed_by_time_not_only_by_count() -> None:
    """On a big model's ring (100 ms a step) the longest interval in steps would be minutes:
    LONGEST_GAP_S bounds it."""
    chooser = DecodeThreads(2)
    run(chooser, 300, lambda step, n: {2: 400.0, 1: 100.0}[n])
    assert chooser.current == 1
    steps_in_gap = int(LONGEST_GAP_S * 1000 / 100) + decode_threads.PROBE_STEPS + 2
    used = run(chooser, steps_in_gap, lambda step, n: {2: 60.0, 1: 100.0}[n], first=300)
    assert 2 in used


@pytest.mark.parametrize("noise", [0.02, 0.05])
def test_counts_within_the_margin_do_not_flap(noise: float) -> None:
    """Two counts about as fast: small differences are noise, and the count stays put."""
    chooser = DecodeThreads(2)
    run(chooser, 3000, lambda step, n: 6.0 * (1 + noise * ((step * 7919) % 13 - 6) / 6))
    assert chooser.switches == 0


def test_one_thread_budget_never_probes() -> None:
    chooser = DecodeThreads(1)
    assert run(chooser, 100, lambda step, n: 5.0) == [1] * 100


def test_a_step_begun_before_a_switch_is_ignored() -> None:
    chooser = DecodeThreads(2)
    run(chooser, 500, lambda step, n: BUSY[n])
    assert chooser.current == 1
    for _ in range(decode_threads.PROBE_STEPS * 4):
        chooser.record(2, 1.0)  # a late report of a count no longer in use and not probed
    assert chooser.current == 1


def test_fixed_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(decode_threads.FIXED_ENV, raising=False)
    assert adaptive_by_default()
    monkeypatch.setenv(decode_threads.FIXED_ENV, "fixed")
    assert not adaptive_by_default()


def test_a_hopeless_probe_ends_after_one_step() -> None:
    """With a core taken, a step with two threads can take many times a normal one (60 ms
    against 7.4): one such step is evidence enough, the probe does not run four."""
    chooser = DecodeThreads(2)
    used = run(chooser, 3000, lambda step, n: {2: 60.0, 1: 7.4}[n])
    assert chooser.current == 1
    after = used[used.index(1) :]
    pairs = [after[i : i + 2] for i in range(len(after) - 1)]
    assert [2, 2] not in pairs
    assert after.count(2) >= 3  # it kept looking, now and then


def test_a_faster_count_in_use_brings_no_early_probe() -> None:
    chooser = DecodeThreads(2)
    run(chooser, 2000, lambda step, n: QUIET[n])
    interval = chooser._interval
    used = run(chooser, 300, lambda step, n: {2: 2.0, 1: 7.5}[n], first=2000)
    assert chooser._interval >= interval  # no reset: a faster count in use is no reason to look
    assert used.count(1) <= decode_threads.PROBE_STEPS
