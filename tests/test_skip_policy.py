"""A test run fails when a skip's reason is not one a machine may have (tests/skip_policy.py),
and passes when every skip is listed; with no list, skips are allowed as pytest has them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.skip_policy import ALLOWED_SKIPS_ENV, read_patterns, skip_reason, unexpected_skips


def test_unlisted_reasons_are_reported_once_each() -> None:
    patterns = [re.compile("chromium is not installed"), re.compile(r"^cannot create a memory cgroup")]
    reasons = [
        "Debian's chromium is not installed (apt-get install chromium)",
        "no reference file at a path outside the checkout",
        "cannot create a memory cgroup here: not root",
        "no reference file at a path outside the checkout",
    ]
    assert unexpected_skips(reasons, patterns) == ["no reference file at a path outside the checkout"]


def test_patterns_file_skips_comments_and_blank_lines(tmp_path: Path) -> None:
    listed = tmp_path / "allowed"
    listed.write_text("# what a machine may lack\n\nno root\n  # indented comment\nno (chromium|firefox)\n")
    assert [p.pattern for p in read_patterns(listed)] == ["no root", "no (chromium|firefox)"]


def test_reason_is_read_from_a_skip_report() -> None:
    assert skip_reason(("tests/x.py", 3, "Skipped: no root here")) == "no root here"


def _run_inner_suite(tmp_path: Path, allowed: str | None) -> subprocess.CompletedProcess[str]:
    """pytest on a two-test suite (one skips "needs a unicorn") with this project's hooks."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "from tests.conftest import pytest_sessionfinish, pytest_terminal_summary\n"
    )
    (suite / "test_inner.py").write_text(
        "import pytest\n\ndef test_runs():\n    assert True\n\n"
        "def test_skips():\n    pytest.skip('needs a unicorn')\n"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    if allowed is not None:
        (tmp_path / "allowed").write_text(allowed)
        env[ALLOWED_SKIPS_ENV] = str(tmp_path / "allowed")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_run_with_an_unlisted_skip_fails_and_names_it(tmp_path: Path) -> None:
    done = _run_inner_suite(tmp_path, "no root\n")
    assert done.returncode == 1, done.stdout
    assert "skips not allowed" in done.stdout
    assert "needs a unicorn" in done.stdout


def test_a_run_whose_skips_are_listed_passes(tmp_path: Path) -> None:
    assert _run_inner_suite(tmp_path, "needs a (unicorn|dragon)\n").returncode == 0


def test_without_a_list_skips_are_allowed(tmp_path: Path) -> None:
    assert _run_inner_suite(tmp_path, None).returncode == 0
