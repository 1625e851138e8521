"""From running daemons to a plan: ask each for its profile and its link to the next ring member
(Profile RPC), fold its --mem-budget into the memory Halda sees, and let Halda choose the
windows. The Halda side stays pure; this module only gathers its inputs over the network.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prima.engine.speculative import DraftConfig
from prima.net.client import NodeClient
from prima.net.codec import NodeProfile
from prima.plan import Plan
from prima.scheduler.compiled_windows import solve_on_compiled
from prima.scheduler.cost_model import device_cost
from prima.scheduler.profile_schema import DeviceProfile, ModelProfile
from prima.scheduler.transfer import TransferEstimate, estimate_transfers

from .head_draft import head_draft_problem

log = logging.getLogger("prima.coordinator")


@dataclass(frozen=True)
class HaldaOptions:
    """How the coordinator plans a ring it did not get --windows for."""

    model: ModelProfile
    max_rounds: int | None = None
    refresh: bool = False  # nodes measure themselves again instead of answering from their cache
    pick_head: bool = False  # reorder: the node with the most memory heads the ring
    # The drafts generations ask for: with pick_head, a node that can draft so heads the ring
    # (only the head drafts), the roomiest of those.
    draft: DraftConfig = DraftConfig()


@dataclass(frozen=True)
class ClusterView:
    """The devices as Halda saw them (ring order, head first), the plan it chose, and what the
    nodes must fetch for it (nodes holding only part of the model)."""

    devices: tuple[DeviceProfile, ...]
    plan: Plan
    transfers: TransferEstimate


def budgeted_device(profile: NodeProfile, model: ModelProfile, *, is_head: bool) -> DeviceProfile:
    """The device with its --mem-budget folded into `ram_available_bytes`.

    primad's budget caps the resident bytes of layer weights only; Halda's RAM budget also holds
    each layer's KV cache and, on the head, the embedding and output head. Scaling the budget by
    (layer + KV) / layer and adding the head's fixed bytes makes Halda's memory rule
    `k*u*(layer + KV) + fixed <= RAM` the same as the daemon's `k*u*layer <= budget`."""
    dev = profile.device
    budget = profile.mem_budget_bytes
    if budget <= 0 or model.layer_bytes <= 0:
        return dev
    per_layer = model.layer_bytes + model.kv_bytes_per_layer
    ram = budget * per_layer // model.layer_bytes
    if is_head:
        ram += model.head_resident_bytes
    return dataclasses.replace(dev, ram_available_bytes=min(dev.ram_available_bytes, ram))


def ring_order(
    profiles: Sequence[NodeProfile], model: ModelProfile, can_head: Sequence[bool] | None = None
) -> list[int]:
    """Indices of `profiles` in ring order: the node with the most memory for layers first (the
    head also holds the embedding and output head), the rest as given. With `can_head`, the
    head is the roomiest of the nodes it allows, if any (those with the draft model asked for)."""
    room = [budgeted_device(p, model, is_head=False).ram_available_bytes for p in profiles]
    able = list(can_head) if can_head is not None else [True] * len(profiles)
    head = max(range(len(profiles)), key=lambda i: (able[i], room[i], -i))
    return [head, *(i for i in range(len(profiles)) if i != head)]


def plan_ring(
    clients: Sequence[NodeClient],
    options: HaldaOptions,
    *,
    epoch: int,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> ClusterView:
    """Profile `clients` (ring order unless `options.pick_head`), measure each link to the next
    member, and solve. The plan lists a subset of the clients' addresses (Halda may drop nodes
    whose hop costs more than they save), head first. `on_progress` hears (nodes profiled,
    nodes in all, the node now) as each node's profile is asked for."""
    model = options.model
    order = list(range(len(clients)))
    if options.pick_head and len(clients) > 1:
        first = [c.profile(refresh=options.refresh) for c in clients]
        can_head = None
        if options.draft.method == "model":
            can_head = [not head_draft_problem(options.draft, c.info()) for c in clients]
        order = ring_order(first, model, can_head)
    ring = [clients[i] for i in order]
    devices = profile_ring(
        ring, model, refresh=options.refresh and not options.pick_head, on_progress=on_progress
    )
    for names in shared_disks(devices):
        log.info("%s read one disk: what they stream from it shares its bandwidth", ", ".join(names))
    if on_progress:
        on_progress(len(ring), len(ring), "solving")
    # An NPU runs only the windows it compiled before serving: a plan naming others is re-made.
    plan, notes = solve_on_compiled(devices, model, max_rounds=options.max_rounds, epoch=epoch)
    for note in notes:
        log.warning("%s", note)
    transfers = estimate_transfers(devices, model, plan)
    log.info("plan epoch %d: %s", epoch, transfers.describe())
    return ClusterView(tuple(devices), plan, transfers)


def hand_plan_view(clients: Sequence[NodeClient], plan: Plan, model: ModelProfile) -> ClusterView:
    """A plan made by hand (its nodes are `clients`, in order) with what its nodes must fetch
    for it, over the links their profiles measure, as `plan_ring` reports Halda's."""
    devices = profile_ring(clients, model, refresh=False)
    return ClusterView(tuple(devices), plan, estimate_transfers(devices, model, plan))


def profile_ring(
    ring: Sequence[NodeClient],
    model: ModelProfile,
    *,
    refresh: bool,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> list[DeviceProfile]:
    """Each node's profile in ring order, its --mem-budget folded in and its link to the next
    member measured."""
    devices = []
    for m, client in enumerate(ring):
        # Node m sends to node m+1; the last sends back to the head.
        peer = ring[(m + 1) % len(ring)].address if len(ring) > 1 else ""
        if on_progress:
            on_progress(m, len(ring), f"profiling {client.name}")
        found = client.profile(peer, refresh=refresh)
        device = budgeted_device(found, model, is_head=m == 0)
        devices.append(dataclasses.replace(device, node_id=client.name, address=client.address))
        cost = device_cost(device, model, is_head=m == 0)
        log.info(
            "profile of %s: %.2f GiB for layers, %.2f ms per layer, disk %.0f MB/s, hop %.2f ms%s",
            client.name,
            device.ram_available_bytes / (1 << 30),
            cost.cpu_ms_per_layer,
            device.disk_read_bytes_per_s / 1e6,
            device.net_latency_ms,
            f", output head {cost.fixed_ms:.2f} ms" if m == 0 else "",
        )
    return devices


def shared_disks(devices: Sequence[DeviceProfile]) -> list[list[str]]:
    """The names of the devices that read one disk, for each disk read by more than one."""
    groups: dict[str, list[str]] = {}
    for d in devices:
        if d.shared_disk:
            groups.setdefault(d.shared_disk, []).append(d.node_id)
    return [names for names in groups.values() if len(names) > 1]
