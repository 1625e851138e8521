"""Halda's message when no plan fits names the constraint that binds: which device, what its
memory would hold, and how much it lacks; the amount is the one that makes a plan fit."""

from __future__ import annotations

import dataclasses
import re

import pytest

from prima.errors import PlanError
from prima.scheduler import halda
from prima.scheduler.cost_model import ring_costs
from prima.scheduler.halda_fit import closest_fit
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile

from .conftest import MiB, make_device, make_model


def _short_mib(message: str) -> int:
    found = re.search(r"(\d+) MiB short", message)
    assert found, message
    return int(found.group(1))


def _with_more_ram(device: DeviceProfile, extra_bytes: int) -> DeviceProfile:
    return dataclasses.replace(device, ram_available_bytes=device.ram_available_bytes + extra_bytes)


def _solve_error(devices: list[DeviceProfile], model: ModelProfile) -> str:
    with pytest.raises(PlanError) as caught:
        halda.solve(devices, model)
    return str(caught.value)


def test_the_heads_memory_for_its_output_head_and_kv_cache_is_named_when_disks_are_fast() -> None:
    """The case of issue 36: fast disks, and the head's memory for the output head plus the KV
    cache of every layer is what binds, not the disk."""
    model = make_model(n_layers=30, layer_mib=2, kv_mib=3, ctx_tokens=2048)
    head = make_device("phone", ram_gib=75 / 1024, disk_gbps=0.8)
    message = _solve_error([head], model)
    assert "disk fast enough" not in message
    assert "the head phone" in message
    assert "output head" in message
    assert "KV cache for its 30 layer(s) at 2048 tokens" in message
    assert "streamed through from disk" in message
    short = _short_mib(message)
    assert short > 0
    # That much more (rounded up to the MiB shown) is enough, and less is not.
    assert halda.solve([_with_more_ram(head, (short + 1) * int(MiB))], model).nodes
    _solve_error([_with_more_ram(head, (short - 2) * int(MiB))], model)


def test_a_head_too_small_for_one_layer_is_named_though_others_have_room() -> None:
    model = make_model(n_layers=8, layer_mib=100, kv_mib=4)
    head = make_device("pi", ram_gib=0.1, disk_gbps=0.0)  # no disk to stream from
    others = [make_device(f"pc{i}", ram_gib=8.0) for i in range(2)]
    message = _solve_error([head, *others], model)
    assert "the head pi" in message
    assert "resident" in message
    assert "pc0" not in message
    short = _short_mib(message)
    halda.solve([_with_more_ram(head, (short + 1) * int(MiB)), *others], model)


def test_the_device_closest_to_taking_the_missing_layers_is_named() -> None:
    """Every device holds some layers, together not all: the one that needs the least more
    memory to take the rest is named, with the shortfall."""
    model = make_model(n_layers=12, layer_mib=200, kv_mib=4)
    devices = [
        make_device("head", ram_gib=0.9, disk_gbps=0.0),
        make_device("laptop", ram_gib=1.0, disk_gbps=0.0),
        make_device("phone", ram_gib=0.5, disk_gbps=0.0),
    ]
    message = _solve_error(devices, model)
    assert "MiB short" in message
    short = closest_fit(ring_costs(devices, model), model.n_layers, halda.divisors(model.n_layers))
    assert short is not None
    named = devices[short.device]
    assert named.node_id in message
    grown = [_with_more_ram(d, short.short_bytes + int(MiB)) if d is named else d for d in devices]
    halda.solve(grown, model)


def test_no_shortfall_when_memory_is_not_what_binds() -> None:
    model = make_model(n_layers=6)
    devices = [make_device("a", ram_gib=8.0), make_device("b", ram_gib=8.0)]
    assert closest_fit(ring_costs(devices, model), model.n_layers, halda.divisors(6)) is None
