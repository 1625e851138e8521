"""argparse types that reject bad values with a usage message instead of a traceback later.

They run while the command line is parsed, so a bad flag is refused (exit code 2, the flag
named by argparse) before any model is resolved, downloaded or loaded."""

from __future__ import annotations

import argparse
import ipaddress
import math

from prima.errors import InputError

MAX_PORT = 65535


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (thread counts, daemon counts, context sizes, rounds)."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (token counts where 0 means none, queue lengths, seeds)."""
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (timeouts in seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (durations that cannot be zero)."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port to listen on: 0..65535 (0 lets the OS pick a free one)."""
    value = _whole_number(text)
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_PORT}, got {value}")
    return value


def node_addresses(text: str) -> list[str]:
    """'host:port,host:port,...' -> the addresses in order (at least one; ports 1..65535)."""
    nodes = [n.strip() for n in text.split(",") if n.strip()]
    if not nodes:
        raise argparse.ArgumentTypeError(f"expected host:port,host:port,..., got {text!r}")
    for n in nodes:
        host, _, number = n.rpartition(":")
        if not host or not number.isdigit() or not 1 <= int(number) <= MAX_PORT:
            raise argparse.ArgumentTypeError(
                f"expected host:port,host:port,... (port 1..{MAX_PORT}), got {n!r}"
            )
    return nodes


def window_sizes(text: str) -> list[int]:
    """'10,10,10' -> layers per window for each node, in ring order (each >= 0)."""
    try:
        sizes = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts like 10,10,10, got {text!r}") from None
    if any(w < 0 for w in sizes):
        raise argparse.ArgumentTypeError(f"layer counts must be >= 0, got {text!r}")
    return sizes


def mdns_interface(text: str) -> str:
    """This device's IP address to browse mDNS on, or 'all' (as $PRIMA_MDNS_INTERFACES takes)."""
    if text.strip().lower() == "all":
        return text.strip()
    try:
        ipaddress.ip_address(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an IP address; give this device's address on the LAN (e.g. 192.168.1.20) or all"
        ) from None
    return text.strip()


def parse_bytes(text: str) -> int:
    """'0', '123456', '512M', '1.5G' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        value = float(number)
    except ValueError:
        raise InputError(f"cannot read {text!r} as bytes; use e.g. 800M, 2G or 123456") from None
    if value < 0:
        raise InputError(f"a size must be >= 0, got {text}")
    return int(value * scale)


def parse_budget(text: str) -> int | None:
    """--mem-budget: 'auto' -> None (what the cgroup or host leaves, read when a plan arrives),
    '0' -> 0 (no limit), else bytes."""
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_bytes(text)
    except InputError:
        raise InputError(
            f"--mem-budget: cannot read {text!r} as bytes; use auto, 0 (no limit) or a size such as 800M or 2G"
        ) from None


def mem_budget(text: str) -> str:
    """--mem-budget as primad reads it (auto, 0 or a size such as 25M), checked here and passed
    on as given to the daemons a command starts."""
    try:
        parse_budget(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--mem-budget: ")) from None
    return text.strip()


def parse_disk_budget(text: str) -> int:
    """--disk-budget: bytes of the model file a node may hold; 0 = no cap."""
    try:
        return parse_bytes(text)
    except InputError:
        raise InputError(
            f"--disk-budget: cannot read {text!r} as bytes; use a size such as 20G or 500M, or 0 for no cap"
        ) from None


def layer_window(text: str, n_layers: int, flag: str = "--window") -> range:
    """'START-END' -> range(START, END), layers [START, END) of a model of `n_layers`."""
    try:
        start, end = (int(v) for v in text.split("-"))
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected START-END, e.g. 0-10 for layers 0 to 9") from None
    if not 0 <= start < end <= n_layers:
        raise InputError(f"{flag} {text}: layers [START, END) must lie in [0, {n_layers}]")
    return range(start, end)
