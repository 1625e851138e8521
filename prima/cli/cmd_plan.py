"""`prima plan`: run Halda and print the plan, for the running daemons or a cluster in a file.

Without --devices it plans the daemons found over mDNS (or given with --nodes): each is asked for
its profile and its link to the next node (Profile RPC); nothing is loaded on them. With
--devices it answers "what would this model do on these devices?" before any daemon runs: the
file holds profiles (from `prima profile --json` on each device, or `prima plan --save`), head first.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from prima.cli.arg_types import node_addresses
from prima.cli.engine_options import DEFAULT_CTX, add_discovery_args, discover_addresses
from prima.coordinator.planner import HaldaOptions, plan_ring
from prima.coordinator.ring import connect_nodes
from prima.errors import InputError, PlanError
from prima.model.files import open_model
from prima.model.gguf_file import GGUFFile
from prima.model.registry import DEFAULT_MODEL, resolve_model
from prima.plan import Plan
from prima.scheduler.compiled_windows import solve_on_compiled
from prima.scheduler.cost_model import member_memory, member_time, ring_costs
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile, devices_to_json, load_cluster_file
from prima.scheduler.transfer import estimate_transfers

_GIB = float(1 << 30)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan a model over the running daemons (discovered or --nodes) or a devices file"
    )
    parser.add_argument(
        "-m",
        "--model",
        help="GGUF path, known model name, or model profile .json "
        f"(default: the devices file's model, else {DEFAULT_MODEL})",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--devices", type=Path, help="JSON file of device profiles, head first (default: the running daemons)"
    )
    where.add_argument(
        "--nodes",
        type=node_addresses,
        metavar="HOST:PORT,...",
        help="running daemons in ring order instead of discovering them",
    )
    add_discovery_args(parser)
    parser.add_argument(
        "--reprofile", action="store_true", help="have the daemons measure themselves again first"
    )
    parser.add_argument("--save", type=Path, help="also write the devices and model to this JSON file")
    parser.add_argument(
        "-c",
        "--ctx",
        type=int,
        help=f"context length to size the KV cache for (tokens; default {DEFAULT_CTX}, as run)",
    )
    parser.add_argument("--max-rounds", type=int, help="consider at most this many rounds k")
    parser.add_argument(
        "-md",
        "--draft-model",
        dest="draft_model",
        metavar="PATH_OR_NAME",
        help="the head also holds this draft model (as with run --draft-model): its weights and KV "
        "cache leave the head that much less memory for layers",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.devices:
        devices, file_model = load_cluster_file(args.devices)
        model = _with_draft(_model_profile(args.model, file_model, args.ctx), args.draft_model)
        plan, notes = solve_on_compiled(devices, model, max_rounds=args.max_rounds)
        for note in notes:
            print(f"prima: {note}", file=sys.stderr)
    else:
        devices, model, plan = _plan_running(args)
    if args.save:
        args.save.write_text(devices_to_json(devices, model) + "\n")
    rows = _node_rows(plan, devices, model)
    transfers = estimate_transfers(devices, model, plan)
    if args.json:
        doc = {
            "model": model.name,
            "n_layers": plan.n_layers,
            "ctx_tokens": model.ctx_tokens,
            "rounds": plan.rounds,
            "predicted_ms_per_token": plan.predicted_ms_per_token,
            "draft_bytes": model.draft_bytes,
            "nodes": rows,
            "dropped": [{"node_id": d.node_id, "reason": d.reason} for d in plan.dropped],
            "transfer_bytes": transfers.n_bytes,
            # null when a node's link was not measured
            "transfer_seconds": transfers.seconds if math.isfinite(transfers.seconds) else None,
            "transfers": [
                {"node_id": t.node_id, "layers": list(t.layers), "bytes": t.n_bytes}
                for t in transfers.nodes
                if t.n_bytes
            ],
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"{model.name}: {plan.n_layers} layers, ctx {model.ctx_tokens}, {plan.rounds} round(s), "
        f"predicted {plan.predicted_ms_per_token:.1f} ms/token"
    )
    if model.draft_bytes:
        print(
            f"the head {plan.head.node_id} also holds a draft model: {model.draft_bytes / (1 << 20):.0f} MiB "
            f"(weights and KV cache), counted in its RAM"
        )
    width = max(len(r["node_id"]) for r in rows) + 2
    print(
        f"{'NODE':<{width}}{'LAYERS':>6} {'ACCEL':>5} {'RAM GiB':>13} {'READ/TOK':>8} {'MS/TOK':>8}  WINDOWS"
    )
    for r in rows:
        ram = f"{r['ram_needed_bytes'] / _GIB:.2f}/{r['ram_budget_bytes'] / _GIB:.2f}"
        disk = f"{r['reread_bytes_per_token'] / (1 << 20):.0f}M" if r["streams"] else "-"
        windows = " ".join(f"[{s},{e})" for s, e in r["windows"])
        print(
            f"{r['node_id']:<{width}}{r['layers']:>6} {r['accel_layers']:>5} {ram:>13} {disk:>8} "
            f"{r['ms_per_token']:>8.1f}  {windows}"
        )
    for d in plan.dropped:
        print(f"dropped {d.node_id}: {d.reason}")
    print(transfers.describe())
    return 0


def _plan_running(args: argparse.Namespace) -> tuple[list[DeviceProfile], ModelProfile, Plan]:
    """Profile the daemons (discovered, or --nodes) and solve; nothing is loaded on them."""
    fingerprint = None
    if args.model is None or not args.model.endswith(".json"):
        loaded = open_model(args.model or DEFAULT_MODEL, layers=range(0))
        fingerprint = loaded.gguf.fingerprint()
    model = _with_draft(_model_profile(args.model, None, args.ctx), args.draft_model)
    if args.nodes:
        addresses = args.nodes
    else:
        addresses = discover_addresses(args, fingerprint)
        if not addresses:
            raise PlanError(
                f"no primad answered over mDNS within {args.discover_timeout:g} s; start primad on the "
                "devices, pass --nodes host:port,..., or plan a file with --devices"
            )
    clients, _ = connect_nodes(addresses, skip_untrusted=not args.nodes)
    try:
        options = HaldaOptions(model, args.max_rounds, args.reprofile, pick_head=not args.nodes)
        view = plan_ring(clients, options, epoch=1)
    finally:
        for c in clients:
            c.close()
    return list(view.devices), model, view.plan


def _model_profile(arg: str | None, from_file: ModelProfile | None, ctx: int | None) -> ModelProfile:
    """The model to plan: an explicit -m wins, then the devices file's, then the default."""
    if arg is None and from_file is not None:
        return _with_ctx(from_file, ctx)
    target = arg or DEFAULT_MODEL
    if target.endswith(".json"):
        try:
            raw = json.loads(Path(target).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{target}: cannot read the model profile ({exc})") from None
        if not isinstance(raw, dict):
            raise InputError(f"{target}: a model profile is a JSON object")
        return _with_ctx(ModelProfile.from_dict(raw), ctx)
    with GGUFFile(resolve_model(target, download=False)) as gguf:
        return ModelProfile.from_gguf(gguf, ctx_tokens=ctx or DEFAULT_CTX)


def _with_draft(model: ModelProfile, draft: str | None) -> ModelProfile:
    """`model` with the --draft-model file's memory on the head (none without one)."""
    if draft is None:
        return model
    with GGUFFile(resolve_model(draft, download=False)) as gguf:
        return model.with_draft(gguf)


def _with_ctx(model: ModelProfile, ctx: int | None) -> ModelProfile:
    if ctx is None:
        return model
    return ModelProfile.from_dict({**model.to_dict(), "ctx_tokens": ctx})


def _node_rows(plan: Plan, devices: list[DeviceProfile], model: ModelProfile) -> list[dict[str, Any]]:
    """Per ring member: its windows, memory use and share of the predicted time."""
    by_id = {d.node_id: d for d in devices}
    ring = [by_id[n.node_id] for n in plan.nodes]
    k = plan.rounds
    rows = []
    for node, cost in zip(plan.nodes, ring_costs(ring, model), strict=True):
        memory = member_memory(cost, k, node.n_layers, node.accel_layers)
        time = member_time(cost, k, node.n_layers, node.accel_layers, sends=len(ring) > 1)
        if memory is None or time is None:
            raise PlanError(f"{node.node_id}'s {node.n_layers} layers do not fit its memory under this plan")
        rows.append(
            {
                "node_id": node.node_id,
                "address": node.address,
                "windows": [[win.start, win.end] for win in node.windows],
                "layers": node.n_layers,
                "accel_layers": memory.shape.accel_layers,
                "streams": memory.streams,
                "pinned_layers": memory.pinned,
                "reread_bytes_per_token": memory.reread_layers * cost.layer_weight_bytes,
                "ram_needed_bytes": memory.needed_bytes,
                "ram_budget_bytes": cost.ram_budget_bytes,
                "ms_per_token": time.own_ms + cost.fixed_ms,
            }
        )
    return rows
