"""Flag types refuse bad values while the command line is parsed: argparse exits with code 2
naming the flag, before anything is loaded. Sizes read as bytes with binary units."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from prima.cli import arg_types as at
from prima.errors import InputError


@pytest.mark.parametrize(
    ("kind", "text", "value"),
    [
        (at.positive_int, "3", 3),
        (at.non_negative_int, "0", 0),
        (at.non_negative_float, "2.5", 2.5),
        (at.port, "0", 0),
        (at.port, "65535", 65535),
        (at.node_addresses, "a:7070, 10.0.0.2:1 ,", ["a:7070", "10.0.0.2:1"]),
        (at.window_sizes, "10,0,12", [10, 0, 12]),
        (at.mdns_interface, " 192.168.1.20 ", "192.168.1.20"),
        (at.mdns_interface, "ALL", "ALL"),
        (at.mem_budget, " 25M ", "25M"),
    ],
)
def test_good_values_are_read(kind: Callable[[str], object], text: str, value: object) -> None:
    assert kind(text) == value


@pytest.mark.parametrize(
    ("kind", "text", "words"),
    [
        (at.positive_int, "0", "at least 1"),
        (at.positive_int, "two", "whole number"),
        (at.non_negative_int, "-1", "at least 0"),
        (at.non_negative_float, "nan", ">= 0"),
        (at.non_negative_float, "-0.5", ">= 0"),
        (at.non_negative_float, "soon", "expected a number"),
        (at.port, "65536", "0..65535"),
        (at.node_addresses, " , ", "host:port"),
        (at.node_addresses, "a:7070,b", "'b'"),
        (at.node_addresses, "a:0", "port 1..65535"),
        (at.window_sizes, "10,x", "layer counts like"),
        (at.window_sizes, "10,-1", ">= 0"),
        (at.mdns_interface, "eth0", "not an IP address"),
        (at.mem_budget, "lots", "cannot read 'lots' as bytes"),
    ],
)
def test_bad_values_are_refused_saying_why(kind: Callable[[str], object], text: str, words: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        kind(text)


def test_argparse_names_the_flag_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="prima")
    p.add_argument("--threads", type=at.positive_int)
    with pytest.raises(SystemExit) as exit_info:
        p.parse_args(["--threads", "0"])
    assert exit_info.value.code == 2
    assert "--threads: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "n"),
    [("0", 0), ("123456", 123456), ("512M", 512 << 20), ("1.5G", 3 << 29), ("2GiB", 2 << 30), ("4kb", 4096)],
)
def test_sizes_read_as_bytes(text: str, n: int) -> None:
    assert at.parse_bytes(text) == n


def test_bad_sizes_are_input_errors_naming_the_flag() -> None:
    with pytest.raises(InputError, match="use e.g. 800M"):
        at.parse_bytes("big")
    with pytest.raises(InputError, match=">= 0"):
        at.parse_bytes("-1G")
    with pytest.raises(InputError, match="--mem-budget: cannot read 'x'"):
        at.parse_budget("x")
    with pytest.raises(InputError, match="--disk-budget: cannot read 'x'"):
        at.parse_disk_budget("x")


def test_a_memory_budget_of_auto_is_read_when_a_plan_arrives() -> None:
    assert at.parse_budget("Auto") is None
    assert at.parse_budget("0") == 0
