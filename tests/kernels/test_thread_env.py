"""Thread-pool defaults: importing prima.kernels.thread_env sets them where the environment does
not choose, keeps what the user set, records which it set, and does nothing with
PRIMA_THREAD_ENV=off. Each case imports it in a fresh interpreter, as an entry point does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from prima.kernels.thread_env import DEFAULTS, workers_spin


def _import_in_child(env: dict[str, str]) -> tuple[dict[str, str | None], list[str]]:
    code = (
        "import json, os\n"
        "from prima.kernels import thread_env\n"
        f"print(json.dumps([{{k: os.environ.get(k) for k in {sorted(DEFAULTS)!r}}}, sorted(thread_env.APPLIED)]))\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in DEFAULTS and k != "PRIMA_THREAD_ENV"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    values, applied = json.loads(out.stdout)
    return values, applied


def test_importing_sets_the_defaults_and_records_them() -> None:
    values, applied = _import_in_child({})
    assert values == DEFAULTS
    assert applied == sorted(DEFAULTS)


def test_what_the_user_set_stays_and_is_not_recorded() -> None:
    values, applied = _import_in_child({"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_NUM_THREADS": "4"})
    assert values["OMP_WAIT_POLICY"] == "ACTIVE"
    assert values["OPENBLAS_NUM_THREADS"] == "4"
    assert values["MKL_NUM_THREADS"] == "1"
    assert applied == ["MKL_NUM_THREADS"]


def test_prima_thread_env_off_leaves_the_environment_alone() -> None:
    values, applied = _import_in_child({"PRIMA_THREAD_ENV": "off"})
    assert values == dict.fromkeys(DEFAULTS)
    assert applied == []


def test_workers_spin_unless_the_policy_is_passive() -> None:
    assert workers_spin({})
    assert workers_spin({"OMP_WAIT_POLICY": "active"})
    assert not workers_spin({"OMP_WAIT_POLICY": " passive "})
