"""`primad --disk-budget`: read as a size, refused with the fix when it is not one, before any
model is opened or fetched."""

from __future__ import annotations

import pytest

from prima.cli import primad
from prima.cli.arg_types import parse_disk_budget


@pytest.mark.parametrize(("text", "expected"), [("0", 0), ("20G", 20 << 30), ("512M", 512 << 20)])
def test_disk_budget_reads_sizes(text: str, expected: int) -> None:
    assert parse_disk_budget(text) == expected


def test_a_bad_disk_budget_stops_primad_with_the_fix(tmp_path, capsys) -> None:
    missing = tmp_path / "not-there.gguf"
    assert primad.main(["--disk-budget", "lots", "--model", str(missing), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "--disk-budget: cannot read 'lots' as bytes" in err
    assert "20G" in err
    assert not missing.exists()
