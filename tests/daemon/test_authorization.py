"""PlanOwnership: the coordinator that loaded a plan owns it; other callers may replace an idle
plan, and only the plan's nodes may touch its sessions."""

from __future__ import annotations

import pytest

from prima.daemon.authorization import PlanOwnership
from prima.net.status import PermissionDeniedError
from tests.daemon.conftest import pair_plan

OWNED = PlanOwnership(pair_plan(), owner="coord-a")


def test_the_owner_and_a_plaintext_caller_may_do_anything() -> None:
    for rpc in ("LoadPlan", "OpenSession", "Relay"):
        OWNED.authorize(rpc, "coord-a", "solo", open_sessions=3)
        OWNED.authorize(rpc, None, "solo", open_sessions=3)


def test_nobody_is_checked_on_a_plan_without_an_owner() -> None:
    PlanOwnership(pair_plan(), owner=None).authorize("LoadPlan", "anyone", "solo", open_sessions=3)


def test_another_coordinator_may_replace_an_idle_plan_only() -> None:
    OWNED.authorize("LoadPlan", "coord-b", "solo", open_sessions=0)
    with pytest.raises(PermissionDeniedError, match="belongs to coordinator .coord-a. and has 2 open"):
        OWNED.authorize("LoadPlan", "coord-b", "solo", open_sessions=2)


def test_sessions_are_for_the_plans_nodes() -> None:
    OWNED.authorize("OpenSession", "head", "solo", open_sessions=1)
    with pytest.raises(PermissionDeniedError, match="may not call OpenSession on node solo"):
        OWNED.authorize("OpenSession", "coord-b", "solo", open_sessions=1)
