"""Taking a plan on: check that it can run on this node, then build its Layout, the node's
windows readied (validated, the accelerator's part compiled, the host's part behind a memory
budget) and its channels to the peers it sends to."""

from __future__ import annotations

from prima.errors import PlanError
from prima.forward.loader import LoadedModel
from prima.forward.placement import Piece, host_layers, split_window
from prima.net import limits
from prima.net.client import NodeClient, Transport
from prima.net.codec import WireDType
from prima.net.limits import shown
from prima.net.status import StaleEpochError
from prima.plan import Plan, Window
from prima.weights.window import LayerWindows

from .node_profile import window_budget
from .state import Layout


def check_plan(
    plan: Plan,
    node_id: str,
    loaded: LoadedModel,
    current_epoch: int | None,
    fetch_sources: tuple[str, ...] = (),
) -> int:
    """This node's index in `plan`, after checking that the plan is well formed, newer than
    `current_epoch`, for this model, and that this node can compute what it is given."""
    cfg = loaded.model.config
    limits.check_epoch(plan.epoch, current_epoch)
    limits.check_node_id(node_id)
    for n in plan.nodes:
        limits.check_node_id(n.node_id)
        limits.check_address(n.address)
    if plan.n_layers != cfg.n_layers:
        raise PlanError(
            f"the plan covers {plan.n_layers} layers but this node's model {loaded.name} has "
            f"{cfg.n_layers}; start every primad with the same --model"
        )
    ids = [n.node_id for n in plan.nodes]
    if node_id not in ids:
        raise PlanError(f"node id {shown(node_id)} is not in the plan (nodes: {ids})")
    for a in fetch_sources:
        limits.check_address(a)
    if current_epoch is not None and plan.epoch < current_epoch:
        raise StaleEpochError(
            f"plan epoch {plan.epoch} is older than the loaded epoch {current_epoch}; "
            "send a plan with a higher epoch"
        )
    me = ids.index(node_id)
    accel = plan.nodes[me].accel_layers
    backend = loaded.model.backend
    if accel and not backend.accelerator:
        raise PlanError(
            f"the plan puts {accel} layers of node {node_id} on an accelerator, but it computes on "
            f"the {backend.name} backend only; plan again from the nodes' profiles"
        )
    return me


def build_layout(
    loaded: LoadedModel,
    plan: Plan,
    me: int,
    wire_dtype: WireDType,
    *,
    node_id: str,
    budget_bytes: int | None,
    identity: Transport,
    fetched: bool = False,
) -> tuple[Layout, set[Piece]]:
    """Node `me`'s windows of `plan`, whose bytes it holds, readied; and the window pieces to
    keep built (every other is released once the layout is installed). `budget_bytes` None
    measures the budget of node `node_id` now (auto). After a fetch the views of layers built over holes are
    forgotten first (the profile may have timed them)."""
    model = loaded.model
    node = plan.nodes[me]
    windows, accel = node.windows, node.accel_layers
    if fetched:
        mine = {i for w in windows for i in range(w.start, w.end)}
        loaded.weights.forget_layers(mine)
        model.release_layers(mine)
    for w in windows:
        loaded.weights.validate(range(w.start, w.end))
    spans = [range(w.start, w.end) for w in windows]
    on_accel = [p for s in spans for p in split_window(s, accel) if p.on_accel]
    # Measured before the accelerator's layers are loaded: where it shares the RAM their copies
    # are charged in full, whether or not the host's count would show them yet.
    auto = budget_bytes is None
    if budget_bytes is None:
        accel_layers = sum(len(p.layers) for p in on_accel)
        budget = window_budget(loaded, node_id, me == 0, accel_layers=accel_layers)
    else:
        budget = budget_bytes
    # The accelerator's part of each window is one compiled model, loaded now (a serving NPU
    # daemon loads only compiled ones); the host's part is read by the layer windows below.
    for piece in on_accel:
        model.window(piece)
    host_windows = [Window(r.start, r.stop) for r in (host_layers(s, accel) for s in spans)]
    layer_windows = LayerWindows(loaded.gguf, loaded.weights, host_windows, budget)
    if layer_windows.limited:
        layer_windows.release_all()  # start from a known resident set
    layer_windows.start()
    # The host runs a window's layers in one call, or one by one while it streams (see the
    # worker): either form may be asked for, so both are kept; the current one is readied.
    keep = {
        p for s in spans for per_layer in (False, True) for p in split_window(s, accel, per_layer=per_layer)
    }
    for span in spans:
        for piece in split_window(span, accel, per_layer=layer_windows.limited):
            model.window(piece)
    hops = tuple(plan.hops())
    peers = {h.node_index for h in hops} | {0}
    clients = {
        i: NodeClient(plan.nodes[i].address, node_id=plan.nodes[i].node_id, identity=identity)
        for i in peers
        if i != me
    }
    layout = Layout(plan, me, hops, layer_windows, clients, wire_dtype, budget if auto else None)
    return layout, keep
