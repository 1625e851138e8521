"""A generation over a daemon's Generate RPC, as the flood and memory tests run it beside an
attack: the tokens it gives alone are those it must still give under attack. A helper, not a test."""

from __future__ import annotations

from prima.engine.sampling import SamplerConfig
from prima.net import codec
from prima.net.proto import prima_pb2 as pb
from prima.net.proto import prima_pb2_grpc as pb_grpc

PROMPT = [1, 504, 3458, 282, 4649, 314]  # ids in SmolLM2's vocabulary, the model these tests run
N_CTX = 64
MAX_TOKENS = 6
TIMEOUT_S = 240.0  # a generation on a daemon kept busy by a flood, on a loaded machine


def generate_tokens(
    stub: pb_grpc.NodeStub, *, max_tokens: int = MAX_TOKENS, timeout_s: float = TIMEOUT_S
) -> list[int]:
    """The ids of up to `max_tokens` tokens generated after PROMPT with the default sampler,
    the whole call bounded by `timeout_s`."""
    req = pb.GenerateRequest(
        prompt_ids=PROMPT, max_tokens=max_tokens, sampler=codec.sampler_to_proto(SamplerConfig()), n_ctx=N_CTX
    )
    return [r.token_id for r in stub.Generate(req, timeout=timeout_s) if not r.done]
