"""What a plan makes nodes fetch: the layers of their windows they lack, over their own link."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from prima.cli.main import main
from prima.plan import plan_from_window_sizes
from prima.scheduler.profile_schema import devices_to_json
from prima.scheduler.transfer import estimate_transfers

MiB = 1 << 20


def test_transfers_are_the_missing_layers_of_each_window_over_its_link(make_device, make_model):
    model = make_model(n_layers=8, layer_mib=100)
    head = dataclasses.replace(
        make_device("head", net_mbps=800.0), held_layers=(4, 5, 6), holds_head_tensors=False
    )
    whole = make_device("whole")  # holds the whole file
    empty = dataclasses.replace(make_device("empty", net_mbps=400.0), held_layers=())
    # Two rounds of windows head 2, whole 1, empty 1: laid out whole, empty, head in each round.
    plan = plan_from_window_sizes([("head", ""), ("whole", ""), ("empty", "")], [2, 1, 1], 2, 8)
    est = estimate_transfers([head, whole, empty], model, plan)
    by_id = {n.node_id: n for n in est.nodes}
    assert by_id["head"].layers == (2, 3, 7)  # its windows [2,4) and [6,8); it holds 6
    assert by_id["whole"].layers == ()
    assert by_id["empty"].layers == (1, 5)
    head_bytes = 3 * model.layer_bytes + model.input_bytes + model.output_bytes
    assert by_id["head"].n_bytes == head_bytes
    assert by_id["head"].seconds == pytest.approx(head_bytes / (800e6 / 8))
    assert by_id["empty"].seconds == pytest.approx(2 * model.layer_bytes / (400e6 / 8))
    assert est.seconds == pytest.approx(by_id["head"].seconds + by_id["empty"].seconds)
    assert "empty 2 layer(s) 200 MiB" in est.describe()


def test_no_transfers_when_every_node_holds_its_layers(make_device, make_model):
    plan = plan_from_window_sizes([("a", ""), ("b", "")], [6, 6], 1, 12)
    est = estimate_transfers([make_device("a"), make_device("b")], make_model(n_layers=12), plan)
    assert est.n_bytes == 0
    assert est.describe().startswith("no transfers")


def test_an_unmeasured_link_gives_no_time(make_device, make_model):
    dev = dataclasses.replace(make_device("a"), held_layers=(), net_bandwidth_bytes_per_s=0.0)
    plan = plan_from_window_sizes([("a", "")], [4], 1, 4)
    est = estimate_transfers([dev], make_model(n_layers=4), plan)
    assert math.isinf(est.seconds)
    assert "time unknown" in est.describe()


def test_cmd_plan_reports_the_transfers(tmp_path, capsys, make_device, make_model):
    """Two equal devices: the plan gives each what it holds but the layers nobody holds, and
    `prima plan` says what will be fetched and how long it should take."""
    model = make_model(n_layers=12, layer_mib=100)
    equal = {"ram_gib": 0.9, "disk_gbps": 0.0}
    head = dataclasses.replace(make_device("head", **equal), held_layers=tuple(range(6, 12)))
    other = dataclasses.replace(make_device("other", **equal), held_layers=tuple(range(5)))
    path = tmp_path / "devices.json"
    path.write_text(devices_to_json([head, other], model))
    assert main(["plan", "--devices", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # Layer 5 is held by no one: one of them fetches it, and nothing else moves.
    assert doc["transfer_bytes"] == model.layer_bytes
    (moved,) = doc["transfers"]
    assert moved["layers"] == [5]
    assert doc["transfer_seconds"] == pytest.approx(model.layer_bytes / (400e6 / 8))
    assert main(["plan", "--devices", str(path)]) == 0
    assert "transfers before the first token: up to 100 MiB" in capsys.readouterr().out
