"""Wire codec: f32 bit-exact, lossy dtypes within their error, and every malformed message rejected."""

from __future__ import annotations

import numpy as np
import pytest

from prima.engine.generate import GenerateRequest, GenerationDone
from prima.engine.sampling import SamplerConfig
from prima.engine.speculative import DraftConfig
from prima.errors import InputError, ProtocolError
from prima.net import codec
from prima.net.codec import Activation, WireDType
from prima.net.proto import prima_pb2 as pb
from prima.net.status import PayloadTooLargeError
from prima.plan import plan_from_window_sizes
from prima.scheduler.profile_schema import DeviceProfile


def _hidden(n: int = 5, d: int = 64, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32) * 3
    x[0, :4] = [0.0, -0.0, np.float32(1e-30), np.float32(-7e4)]
    return x


def test_f32_roundtrip_is_bit_exact() -> None:
    x = _hidden()
    y = codec.decode_tensor(codec.encode_tensor(x, WireDType.F32))
    assert y.dtype == np.float32
    assert y.tobytes() == x.tobytes()


@pytest.mark.parametrize(
    ("dtype", "rel"), [(WireDType.F16, 1e-3), (WireDType.BF16, 8e-3), (WireDType.Q8_BLOCK, 1e-2)]
)
def test_lossy_dtypes_stay_within_their_error(dtype: WireDType, rel: float) -> None:
    x = _hidden(n=7, d=48)  # 336 values: not a whole number of Q8 blocks per row
    x[0, 3] = -60.0  # keep within f16 range
    msg = codec.encode_tensor(x, dtype)
    y = codec.decode_tensor(msg)
    assert y.shape == x.shape
    assert np.linalg.norm(y - x) / np.linalg.norm(x) < rel
    assert len(msg.data) < x.nbytes


def test_bf16_rounds_to_nearest_even() -> None:
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9], dtype=np.float32)
    y = codec.decode_tensor(codec.encode_tensor(x, WireDType.BF16))
    assert list(y) == [1.0, 1.0 + 2**-6, 1.0]


def test_activation_roundtrip() -> None:
    act = Activation("s1", 3, 2, np.arange(10, 15), _hidden(), batch_seq=4, all_rows=True)
    back = codec.decode_activation(codec.encode_activation(act), d_model=64, max_tokens=64)
    assert (back.session_id, back.plan_epoch, back.hop_index, back.batch_seq) == ("s1", 3, 2, 4)
    assert back.all_rows
    assert list(back.positions) == list(range(10, 15))
    assert back.hidden.tobytes() == act.hidden.tobytes()


def _msg(**changes: object) -> pb.Activation:
    msg = codec.encode_activation(Activation("s1", 1, 0, np.arange(5), _hidden()))
    for key, value in changes.items():
        if key == "data":
            msg.hidden.data = value  # type: ignore[assignment]
        elif key == "dtype":
            msg.hidden.dtype = value  # type: ignore[assignment]
        elif key == "shape":
            del msg.hidden.shape[:]
            msg.hidden.shape.extend(value)  # type: ignore[arg-type]
        elif key == "positions":
            del msg.positions[:]
            msg.positions.extend(value)  # type: ignore[arg-type]
        else:
            setattr(msg, key, value)
    return msg


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"shape": [5, 32]}, "shape"),
        ({"shape": [5, 64, 1]}, "shape"),
        ({"data": b"\0" * 12}, "data bytes"),
        ({"dtype": 9}, "unknown tensor dtype"),
        ({"positions": [0, 1, 2]}, "positions"),
        ({"positions": [0, 2, 3, 4, 5]}, "consecutive"),
        ({"session_id": ""}, "session"),
    ],
)
def test_malformed_activation_is_a_protocol_error(changes: dict[str, object], words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        codec.decode_activation(_msg(**changes), d_model=64, max_tokens=64)


def test_oversized_batch_is_payload_too_large() -> None:
    with pytest.raises(PayloadTooLargeError, match="limit"):
        codec.decode_activation(_msg(), d_model=64, max_tokens=4)


def test_plan_roundtrip() -> None:
    plan = plan_from_window_sizes([("a", "h:1"), ("b", "h:2"), ("c", "h:3")], [2, 3, 3], 2, 16, epoch=7)
    assert codec.plan_from_proto(codec.plan_to_proto(plan)) == plan


def test_invalid_plan_is_a_protocol_error() -> None:
    msg = codec.plan_to_proto(plan_from_window_sizes([("a", "h:1"), ("b", "h:2")], [2, 2], 1, 4))
    msg.n_layers = 5
    with pytest.raises(ProtocolError, match="unassigned"):
        codec.plan_from_proto(msg)


def test_sampler_roundtrip() -> None:
    for cfg in (SamplerConfig(), SamplerConfig(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=42)):
        assert codec.sampler_from_proto(codec.sampler_to_proto(cfg)) == cfg


def test_node_profile_round_trips_and_bad_json_is_a_protocol_error() -> None:
    dev = DeviceProfile(
        "n0", "127.0.0.1:7600", ram_total_bytes=8, ram_available_bytes=4, cpu_flops={"F32": 1e9}
    )
    back = codec.node_profile_from_proto(codec.node_profile_to_proto(codec.NodeProfile(dev, 123, 4.5)))
    assert back == codec.NodeProfile(dev, 123, 4.5)
    for bad, words in [("{", "not JSON"), ("[1]", "not a JSON object"), ('{"node_id": 3}', "node_id")]:
        with pytest.raises(ProtocolError, match=words):
            codec.node_profile_from_proto(pb.ProfileReply(device_profile_json=bad))


def test_generate_request_round_trips_a_resumed_generation() -> None:
    req = GenerateRequest((1, 2, 3), 5, SamplerConfig(temperature=0.5, seed=3), (0,), n_ctx=64, first_step=2)
    back = codec.generate_request_from_proto(codec.generate_request_to_proto(req), vocab_size=10)
    assert back == req


def test_generate_request_and_done_carry_the_draft() -> None:
    req = GenerateRequest((1, 2, 3), 5, SamplerConfig(), (0,), n_ctx=64, draft=DraftConfig("lookup", 5))
    assert codec.generate_request_from_proto(codec.generate_request_to_proto(req), vocab_size=10) == req
    done = GenerationDone("eos", 1.5, 2.5, draft_tokens=7, accepted_tokens=3)
    assert codec.token_event_from_proto(codec.token_event_to_proto(done)) == done


def test_the_done_event_carries_the_cached_prompt_tokens() -> None:
    done = GenerationDone("length", 1.0, 2.0, cached_tokens=41)
    assert codec.token_event_from_proto(codec.token_event_to_proto(done)).cached_tokens == 41  # type: ignore[union-attr]


def test_a_bad_draft_from_a_peer_is_an_input_error() -> None:
    msg = codec.generate_request_to_proto(GenerateRequest((1,), 5, SamplerConfig()))
    msg.draft = "oracle"
    with pytest.raises(InputError, match="unknown draft method 'oracle'"):
        codec.generate_request_from_proto(msg, vocab_size=10)


def test_a_request_for_hidden_states_gets_them_with_its_last_reply() -> None:
    req = GenerateRequest((1, 2, 3), 0, n_ctx=64, want_hidden_states=True)
    assert codec.generate_request_from_proto(codec.generate_request_to_proto(req), vocab_size=10) == req
    hidden = _hidden()
    done = codec.token_event_from_proto(
        codec.token_event_to_proto(GenerationDone("length", 1.0, 0.0, None, hidden_states=hidden))
    )
    assert isinstance(done, GenerationDone)
    assert done.hidden_states is not None
    assert done.hidden_states.tobytes() == hidden.tobytes()
    flat = codec.token_event_to_proto(GenerationDone("length", 1.0, 0.0, None, hidden_states=hidden[0]))
    with pytest.raises(ProtocolError, match="n_tokens, d_model"):
        codec.token_event_from_proto(flat)
