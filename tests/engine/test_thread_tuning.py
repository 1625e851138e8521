"""Thread tuning: the choice rule, the record it keeps, and its effect on the environment of the
processes that run the kernels. The measurements are real decode steps in child processes; no
test asserts how fast anything is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prima.engine import thread_tuning as tt
from prima.engine.thread_tuning import PASSIVE, SPIN, Measurement, ThreadSetting
from tests.conftest import tiny_model_path


def m(threads: int, wait: str, ms: float) -> Measurement:
    return Measurement(ThreadSetting(threads, wait), ms)


def test_choose_takes_the_fastest() -> None:
    measured = [m(1, PASSIVE, 12.0), m(2, SPIN, 8.0), m(2, PASSIVE, 11.0)]
    assert tt.choose(measured) == ThreadSetting(2, SPIN)


def test_more_threads_only_when_faster_than_one() -> None:
    # Two threads slower than one (the AMD VM of issue 14 with sleeping workers): one thread.
    assert tt.choose([m(1, PASSIVE, 16.0), m(2, SPIN, 17.0), m(2, PASSIVE, 30.0)]) == ThreadSetting(
        1, PASSIVE
    )


def test_ties_go_to_fewer_threads_then_to_sleeping_workers() -> None:
    assert tt.choose([m(1, PASSIVE, 10.1), m(2, SPIN, 10.0)]) == ThreadSetting(1, PASSIVE)
    assert tt.choose([m(1, PASSIVE, 20.0), m(2, SPIN, 10.0), m(2, PASSIVE, 10.2)]) == ThreadSetting(
        2, PASSIVE
    )


def test_candidates_cover_one_thread_and_each_wait_policy() -> None:
    assert tt.candidates(1) == [ThreadSetting(1, PASSIVE)]
    assert set(tt.candidates(4)) == {
        ThreadSetting(1, PASSIVE),
        ThreadSetting(4, SPIN),
        ThreadSetting(4, PASSIVE),
    }


def test_settings_name_their_environment() -> None:
    assert ThreadSetting(2, SPIN).env() == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": tt.SPIN_COUNT}
    assert ThreadSetting(2, PASSIVE).env() == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}


def test_a_damaged_record_is_measured_again(tmp_path: Path) -> None:
    path = tmp_path / "threads.json"
    path.write_text("{not json")
    assert tt.load_record(path) is None
    tt.save_record(path, ThreadSetting(2, SPIN), [m(2, SPIN, 1.0)])
    assert tt.load_record(path) == (ThreadSetting(2, SPIN), [m(2, SPIN, 1.0)])


def _apply_in_child(env: dict[str, str], setting: ThreadSetting) -> dict[str, str | None]:
    """Run apply() in a fresh interpreter (as an entry point would, before numba's pool starts)
    and return the wait variables it leaves."""
    code = (
        "import json, os, prima.kernels.thread_env\n"
        "from prima.engine.thread_tuning import ThreadSetting, apply\n"
        f"ok = apply(ThreadSetting({setting.threads}, {setting.wait!r}))\n"
        "print(json.dumps({'ok': ok, **{k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}}))\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in tt.WAIT_KEYS and k != "PRIMA_THREAD_ENV"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_apply_replaces_only_prima_defaults() -> None:
    # prima's default (passive, set by thread_env) gives way to the measured choice ...
    assert _apply_in_child({}, ThreadSetting(2, SPIN)) == {
        "ok": True,
        "OMP_WAIT_POLICY": None,
        "GOMP_SPINCOUNT": tt.SPIN_COUNT,
    }
    # ... but what the user exported stays.
    assert _apply_in_child({"OMP_WAIT_POLICY": "ACTIVE"}, ThreadSetting(2, PASSIVE)) == {
        "ok": False,
        "OMP_WAIT_POLICY": "ACTIVE",
        "GOMP_SPINCOUNT": None,
    }


@pytest.mark.slow
def test_tune_measures_each_candidate_once_then_reads_the_record(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "threads.json"
    monkeypatch.setattr(tt, "record_path", lambda fingerprint, cores: record)
    # Kept however busy the test machine is: the load it sees is the one the test gives.
    chosen, measured, fresh = tt.tune(smollm2_path, "f" * 64, cores=2, readings=_load(0.0, 0.0))
    assert fresh
    assert record.exists()
    assert [x.setting for x in measured] == tt.candidates(2)
    assert all(x.ms_per_step > 0 for x in measured)
    assert chosen == tt.choose(measured)
    again = tt.tune(smollm2_path, "f" * 64, cores=2)
    assert again == (chosen, measured, False)


def test_a_failed_measurement_leaves_the_defaults(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only speed depends on the choice, so a measurement that fails (a child killed by a memory
    limit, say) is a warning, not the end of the user's run."""

    def broken(model: object, setting: ThreadSetting, timeout_s: float = 0.0) -> float:
        raise tt.TuningError(f"timing a decode step with {setting.describe()} failed")

    monkeypatch.delenv(tt.TUNING_ENV, raising=False)
    monkeypatch.setattr(tt, "record_path", lambda fingerprint, cores: tmp_path / "threads.json")
    monkeypatch.setattr(tt, "measure", broken)
    with caplog.at_level("WARNING", logger="prima.engine"):
        assert tt.tuned_setting(smollm2_path) is None
    assert "running with the default threads" in caplog.text
    assert not (tmp_path / "threads.json").exists()


CORES = os.cpu_count() or 1


class Readings:
    """The wall clock and CPU times OthersLoad reads, scripted: one tuple per reading."""

    def __init__(self, *readings: tuple[float, float, float]) -> None:
        self.readings = list(readings)

    def __call__(self) -> tuple[float, float, float]:
        return self.readings.pop(0)


def _others_busy(share: float, wall_s: float = 2.0, ours_s: float = 1.5) -> Readings:
    """A `with` block of `wall_s` in which other processes kept `share` of the cores busy and
    this process and its children used `ours_s` of CPU."""
    start = (1000.0, 500.0, 10.0)
    end = (1000.0 + wall_s, 500.0 + share * CORES * wall_s + ours_s, 10.0 + ours_s)
    return Readings(start, end)


def _load(before: float, during: float) -> Readings:
    """Readings for tune: other processes' share of the cores in its sample before measuring,
    then while it measures."""
    return Readings(*_others_busy(before).readings, *_others_busy(during).readings)


def test_others_load_sees_other_processes_not_its_own_work() -> None:
    with tt.OthersLoad(_others_busy(0.0, ours_s=1.9)) as idle:
        pass
    with tt.OthersLoad(_others_busy(0.8)) as busy:
        pass
    assert idle.busy_share() == 0.0
    assert busy.busy_share() == pytest.approx(0.8)


def test_others_load_reads_this_machine() -> None:
    with tt.OthersLoad() as load:
        sum(i * i for i in range(100_000))
    assert load.busy_share() >= 0.0


def _measured(model: object, setting: ThreadSetting, timeout_s: float = 0.0) -> float:
    return 10.0 / setting.threads


def test_threads_timed_on_a_busy_machine_are_used_but_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A choice measured beside other work (a test suite, a compile) would stay wrong for good:
    it is used for this run and measured again next time."""
    record = tmp_path / "threads.json"
    monkeypatch.setattr(tt, "record_path", lambda fingerprint, cores: record)
    monkeypatch.setattr(tt, "measure", _measured)
    with caplog.at_level("WARNING", logger="prima.engine"):
        chosen, _, fresh = tt.tune("model.gguf", "f" * 64, cores=2, readings=_load(0.0, 0.8))
    assert fresh
    assert chosen.threads == 2
    assert not record.exists()
    assert "without recording it" in caplog.text


def test_a_machine_busy_before_timing_starts_on_the_defaults_without_timing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Beside a busy core, timing the choices takes minutes and gives one that is not kept: a
    start (a laptop in use) goes ahead at once on all threads sleeping between launches."""

    def not_called(model: object, setting: ThreadSetting, timeout_s: float = 0.0) -> float:
        raise AssertionError(f"measured {setting.describe()} on a busy machine")

    record = tmp_path / "threads.json"
    monkeypatch.setattr(tt, "record_path", lambda fingerprint, cores: record)
    monkeypatch.setattr(tt, "measure", not_called)
    monkeypatch.setattr(tt, "LOAD_SAMPLE_S", 0.0)
    with caplog.at_level("WARNING", logger="prima.engine"):
        chosen, measured, fresh = tt.tune("model.gguf", "f" * 64, cores=2, readings=_others_busy(0.8))
    assert (chosen, measured, fresh) == (ThreadSetting(2, tt.PASSIVE), [], False)
    assert not record.exists()
    assert "without timing the choices" in caplog.text
    monkeypatch.setattr(tt, "measure", _measured)  # `prima tune` (refresh) measures all the same
    chosen, measured, fresh = tt.tune(
        "model.gguf", "f" * 64, cores=2, refresh=True, readings=_others_busy(0.0)
    )
    assert fresh
    assert [m.setting for m in measured] == tt.candidates(2)


# big.LITTLE: capacities as Linux reports them (cpu<N>/cpu_capacity, 1024 the fastest kind).
RK3588 = {**dict.fromkeys(range(4), 414), **dict.fromkeys(range(4, 8), 1024)}  # 4x A55 + 4x A76
PHONE = {**dict.fromkeys(range(4), 325), **dict.fromkeys(range(4, 7), 870), 7: 1024}  # 4 + 3 + 1


def test_big_cores_are_those_above_the_slowest_kind() -> None:
    assert tt.big_cores(RK3588, range(8)) == (4, 5, 6, 7)
    assert tt.big_cores(PHONE, range(8)) == (4, 5, 6, 7)  # the prime core with the middle ones
    assert tt.big_cores(RK3588, [2, 3, 6]) == (6,)  # within the process's cpuset


def test_cores_of_one_kind_have_no_big_cores() -> None:
    assert tt.big_cores(dict.fromkeys(range(4), 1024), range(4)) == ()
    assert tt.big_cores(RK3588, [4, 5, 6, 7]) == ()  # already on the big cores only
    assert tt.big_cores({}, range(4)) == ()  # x86, a VM: no capacities
    assert tt.big_cores({0: 414, 1: 1024}, [0, 1, 2]) == ()  # a usable core of unknown kind


def _sysfs(root: Path, capacities: dict[int, int]) -> Path:
    """A made-up /sys/devices/system/cpu with these cores' cpu_capacity files."""
    for cpu, capacity in capacities.items():
        (root / f"cpu{cpu}").mkdir(parents=True)
        (root / f"cpu{cpu}" / "cpu_capacity").write_text(f"{capacity}\n")
    (root / "cpufreq").mkdir()  # siblings that are not cores
    (root / "online").write_text("0-7\n")
    return root


def test_capacities_are_read_from_sysfs(tmp_path: Path) -> None:
    assert tt.cpu_capacities(_sysfs(tmp_path / "rk3588", RK3588)) == RK3588
    damaged = _sysfs(tmp_path / "damaged", {0: 414, 1: 1024})
    (damaged / "cpu1" / "cpu_capacity").write_text("?\n")
    (damaged / "cpu2").mkdir()  # a core without the file
    assert tt.cpu_capacities(damaged) == {0: 414}
    assert tt.cpu_capacities(tmp_path / "none") == {}


def test_big_cores_are_candidates_pinned() -> None:
    big = (4, 5, 6, 7)
    assert tt.candidates(8, big) == [
        *tt.candidates(8),
        ThreadSetting(4, SPIN, big),
        ThreadSetting(4, PASSIVE, big),
    ]
    assert tt.candidates(2, (1,)) == [*tt.candidates(2), ThreadSetting(1, PASSIVE, (1,))]
    assert (
        ThreadSetting(4, SPIN, big).describe()
        == "4 threads on big cores 4,5,6,7, workers spin briefly then sleep"
    )


def test_a_pinned_choice_is_recorded_with_its_cores(tmp_path: Path) -> None:
    path = tmp_path / "threads.json"
    pinned = Measurement(ThreadSetting(4, PASSIVE, (4, 5, 6, 7)), 1.0)
    tt.save_record(path, pinned.setting, [m(8, SPIN, 2.0), pinned])
    assert tt.load_record(path) == (pinned.setting, [m(8, SPIN, 2.0), pinned])


def test_apply_pins_the_process_and_the_threads_it_starts_later() -> None:
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import json, os, threading, prima.kernels.thread_env\n"
        "from prima.engine.thread_tuning import PASSIVE, ThreadSetting, apply\n"
        f"ok = apply(ThreadSetting(1, PASSIVE, ({cpu},)))\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
        "t.start(); t.join()\n"
        "print(json.dumps({'ok': ok, 'main': sorted(os.sched_getaffinity(0)), 'thread': seen[0]}))\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in tt.WAIT_KEYS and k != "PRIMA_THREAD_ENV"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == {"ok": True, "main": [cpu], "thread": [cpu]}


def test_tune_measures_the_big_cores_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine made big.LITTLE by a made-up sysfs: its first usable core big, the others
    little. Every candidate is timed for real, the pinned one in a child that checks it ran on
    that core alone; the choice is whichever was fastest (no timing is asserted)."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs two usable cores to pretend one of them is big")
    root = _sysfs(tmp_path / "cpu", {cpu: 1024 if cpu == usable[0] else 512 for cpu in usable})
    monkeypatch.setattr(tt, "record_path", lambda fingerprint, cores: tmp_path / "threads.json")
    monkeypatch.setattr(tt, "MAX_OTHERS_BUSY", 1.0)  # kept however busy the test machine is
    model = tiny_model_path("tiny-qwen2")
    chosen, measured, fresh = tt.tune(model, "f" * 64, cores=len(usable), cpu_root=root)
    assert fresh
    assert [x.setting for x in measured] == tt.candidates(len(usable), (usable[0],))
    assert measured[-1].setting == ThreadSetting(1, PASSIVE, (usable[0],))
    assert all(x.ms_per_step > 0 for x in measured)
    assert chosen == tt.choose(measured)
    assert tt.load_record(tmp_path / "threads.json") == (chosen, measured)


def test_threads_timed_on_a_quiet_machine_are_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "threads.json"
    monkeypatch.setattr(tt, "record_path", lambda fingerprint, cores: record)
    monkeypatch.setattr(tt, "measure", _measured)
    chosen, measured, fresh = tt.tune(
        "model.gguf", "f" * 64, cores=2, readings=_load(tt.MAX_OTHERS_BUSY, tt.MAX_OTHERS_BUSY)
    )
    assert fresh
    assert tt.load_record(record) == (chosen, measured)
