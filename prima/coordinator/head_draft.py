"""Whether a ring's head can draft as a request asks (`--draft model`), and what to do when not.

Only the head runs a draft model (primad --draft-model), and its Info names it. Two cases:

- A fresh start whose head has no draft model, or another one than asked for: refused before
  any generation (`check_head_drafts`). The user is there to fix it with one flag, and drafts
  only change speed: a run that quietly went on at plain decoding's speed, with a warning
  scrolled past, would hide the mistake.
- A failover onto a head started without it (or with another file): the generation is under
  way, and its output matters more than its speed. It goes on (`fall_back`), drafting by prompt
  lookup instead: lookup needs no model, proposes nothing on text that does not repeat (so a
  step costs what plain decoding's does) and pays where text repeats; on a ring, where every
  token costs a trip round it, that is the best left. The coordinator logs why, and the
  generation's GenerationDone.draft_off (`prima run --json` timings) says so.
"""

from __future__ import annotations

import dataclasses

from prima.engine.generate import GenerateRequest
from prima.engine.speculative import DraftConfig
from prima.errors import InputError
from prima.net.node_status import NodeStatus

FALLBACK_METHOD = "lookup"


def head_draft_problem(draft: DraftConfig, head: NodeStatus) -> str:
    """Why the head described by `head` cannot draft as `draft` asks; "" when it can."""
    if draft.method != "model":
        return ""
    if not head.draft_model_fingerprint:
        return f"node {head.node_id} (the ring's head) has no draft model"
    expected = draft.model_fingerprint
    if expected and expected != head.draft_model_fingerprint:
        return (
            f"node {head.node_id} (the ring's head) drafts with {head.draft_model_name} "
            f"(fingerprint {head.draft_model_fingerprint[:12]}), not the draft model asked for "
            f"(fingerprint {expected[:12]})"
        )
    return ""


def check_head_drafts(draft: DraftConfig, head: NodeStatus) -> None:
    """InputError, naming the head and the fix, when it cannot draft as `draft` asks."""
    problem = head_draft_problem(draft, head)
    if not problem:
        return
    if not head.draft_model_fingerprint:
        raise InputError(
            f"{problem}: start its primad with --draft-model PATH_OR_NAME, or use --draft lookup"
        )
    raise InputError(
        f"{problem}: start its primad with --draft-model of the file given here, "
        "or omit --draft-model to draft with the head's own, or use --draft lookup"
    )


def fall_back(request: GenerateRequest, head: NodeStatus) -> tuple[GenerateRequest, str]:
    """`request` as the head can run it, and why its drafts changed ("" when they did not): a
    draft model the head lacks is replaced by prompt lookup of as many tokens."""
    problem = head_draft_problem(request.draft, head)
    if not problem:
        return request, ""
    draft = DraftConfig(FALLBACK_METHOD, request.draft.max_tokens)
    reason = f"{problem} after a failover: drafted by prompt lookup instead"
    return dataclasses.replace(request, draft=draft), reason
