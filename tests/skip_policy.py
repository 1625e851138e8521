"""Which skips a run may have: a skip says what this machine cannot do (no root for cgroups, no
Chromium, a CPU without some instruction), never that the project failed to ship a file.

With $PRIMA_ALLOWED_SKIPS naming a file of regular expressions (one a line, `#` comments), a
test run whose skip reasons do not all match one of them fails, listing them (.ci/run sets it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

ALLOWED_SKIPS_ENV = "PRIMA_ALLOWED_SKIPS"


def read_patterns(path: Path) -> list[re.Pattern[str]]:
    """The expressions in `path`, blank lines and `#` comments left out."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [re.compile(line.strip()) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def unexpected_skips(reasons: Iterable[str], patterns: list[re.Pattern[str]]) -> list[str]:
    """The reasons no pattern matches (searched anywhere in the reason), once each, in order."""
    return [r for r in dict.fromkeys(reasons) if not any(p.search(r) for p in patterns)]


def skip_reason(longrepr: object) -> str:
    """The reason of a skipped test's report (pytest's `(path, line, "Skipped: why")`)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def allowed_patterns() -> list[re.Pattern[str]] | None:
    """The patterns of $PRIMA_ALLOWED_SKIPS, or None when it is unset (any skip is allowed)."""
    name = os.environ.get(ALLOWED_SKIPS_ENV, "")
    return read_patterns(Path(name)) if name else None
