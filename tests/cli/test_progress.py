"""Progress bars on a real terminal (a pty): a bar ends before the next stage line, so the line
reads alone instead of trailing the bar ("compiling: 100%|...| 2/2prima: kernels compiled")."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

READ_TIMEOUT_S = 60.0

# The compile's order of events: steps reported, then the stage line while the bar is open.
CHILD = """
from prima.cli.progress import FetchBar, StepBar, stage
with StepBar("compiling") as bar:
    bar(0, 3, "forward pass")
    bar(1, 3, "decode")
    stage("a line while the bar runs")
    bar(2, 3, "probe")
    bar(3, 3, "done")
    stage("kernels compiled in 1 s")
"""


def _screen(raw: str) -> list[str]:
    """The lines a terminal shows for `raw`: a carriage return goes back to column 0 and text
    overwrites what was there; escape sequences (cursor moves, clears) are dropped."""
    lines: list[list[str]] = [[]]
    col = 0
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\x1b":  # CSI: ESC [ params final-byte
            i += 2
            while i < len(raw) and not raw[i].isalpha():
                i += 1
        elif ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append([])
            col = 0
        else:
            line = lines[-1]
            line.extend(" " * (col - len(line) + 1) if col >= len(line) else "")
            line[col] = ch
            col += 1
        i += 1
    return ["".join(line).rstrip() for line in lines]


def _run_in_pty(code: str) -> str:
    main, child = pty.openpty()
    # A terminal of 24 rows by 120 columns: tqdm sizes its bar to it (at 0 columns it draws nothing).
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    repo = Path(__file__).resolve().parents[2]
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=child, stdout=child, stderr=child, cwd=repo, close_fds=True
    ) as proc:
        os.close(child)
        out = b""
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            out += data
        proc.wait(READ_TIMEOUT_S)
    os.close(main)
    assert proc.returncode == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def test_a_bar_ends_before_the_next_stage_line() -> None:
    raw = _run_in_pty(CHILD)
    assert "compiling" in raw  # the bar did draw: this is a terminal
    screen = _screen(raw)
    assert "prima: a line while the bar runs" in screen
    assert "prima: kernels compiled in 1 s" in screen
    assert not any("compiling" in line and "prima:" in line for line in screen), screen
