"""The activation link's frames: an activation survives the trip in every wire dtype as it does
in a Relay message, and every malformed payload is a ProtocolError naming what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from prima.errors import ProtocolError
from prima.net import codec, limits, link_wire
from prima.net.codec import Activation, WireDType
from prima.net.status import PayloadTooLargeError

D = 64


def _act(n: int = 5, first: int = 10, **fields: object) -> Activation:
    rng = np.random.default_rng(n)
    hidden = (rng.standard_normal((n, D)) * 3).astype(np.float32)
    return Activation(
        str(fields.get("session_id", "s1")),
        3,
        2,
        np.arange(first, first + n),
        hidden,
        batch_seq=4,
        all_rows=True,
    )


def _payload(act: Activation, dtype: WireDType = WireDType.F32) -> bytes:
    frame = link_wire.activation_frame(act, dtype)
    length, kind = link_wire.HEADER.unpack_from(frame)
    assert kind == link_wire.ACTIVATION
    assert length == len(frame) - link_wire.HEADER.size
    return frame[link_wire.HEADER.size :]


def _parse(payload: bytes | bytearray, max_tokens: int = 64) -> Activation:
    return link_wire.parse_activation(payload, d_model=D, max_tokens=max_tokens)


@pytest.mark.parametrize("dtype", list(WireDType))
def test_an_activation_arrives_as_a_relay_message_would_bring_it(dtype: WireDType) -> None:
    act = _act()
    got = _parse(_payload(act, dtype))
    relayed = codec.decode_activation(codec.encode_activation(act, dtype), d_model=D, max_tokens=64)
    assert (got.session_id, got.plan_epoch, got.hop_index, got.batch_seq, got.all_rows) == (
        "s1",
        3,
        2,
        4,
        True,
    )
    assert list(got.positions) == list(range(10, 15))
    assert got.hidden.dtype == np.float32
    assert got.hidden.tobytes() == relayed.hidden.tobytes()
    if dtype == WireDType.F32:
        assert got.hidden.tobytes() == act.hidden.tobytes()
    got.hidden[0, 0] = 1.0  # the node computes in place: the rows are its own, not the frame's


@pytest.mark.parametrize("session_id", ["s123", "s12"])  # rows 4-byte aligned in the frame, or not
def test_rows_read_off_the_socket_are_used_in_place_where_aligned(session_id: str) -> None:
    """A frame read from the socket is a bytearray: aligned float32 rows are an array over it
    (no copy), misaligned ones a copy; either way they are the sender's rows, and writable."""
    act = _act(session_id=session_id)
    payload = bytearray(_payload(act))
    got = _parse(payload)
    assert got.hidden.tobytes() == act.hidden.tobytes()
    assert got.hidden.flags.aligned
    assert got.hidden.flags.c_contiguous
    assert np.shares_memory(got.hidden, np.frombuffer(payload, np.uint8)) == (len(session_id) % 4 == 0)
    got.hidden[0, 0] = 1.0


def test_a_one_row_activation_with_a_unicode_session_id() -> None:
    act = _act(n=1, first=0, session_id="sesión-1")
    got = _parse(_payload(act))
    assert got.session_id == "sesión-1"
    assert list(got.positions) == [0]


def _with_fields(act: Activation, **changes: int) -> bytes:
    """`act`'s payload with header fields replaced (names as in ACTIVATION_HEADER's comment)."""
    payload = _payload(act)
    names = ("epoch", "hop", "seq", "first", "rows", "cols", "dtype", "all_rows", "sid_len")
    fields = dict(zip(names, link_wire.ACTIVATION_HEADER.unpack_from(payload), strict=True))
    fields.update(changes)
    return link_wire.ACTIVATION_HEADER.pack(*fields.values()) + payload[link_wire.ACTIVATION_HEADER.size :]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"cols": 32}, "shape"),
        ({"rows": 0}, "no rows"),
        ({"rows": 4}, "payload of"),
        ({"dtype": 9}, "unknown tensor dtype"),
        ({"dtype": int(WireDType.F16)}, "payload of"),
        ({"first": -1}, "non-negative"),
        ({"first": (1 << 63) - 2}, "non-negative"),
        ({"all_rows": 2}, "0 or 1"),
        ({"sid_len": 0}, "no session_id"),
        ({"sid_len": 1}, "payload of"),
    ],
)
def test_a_malformed_activation_is_a_protocol_error(changes: dict[str, int], words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        _parse(_with_fields(_act(), **changes))


def test_cut_and_padded_payloads_and_bad_session_ids_are_protocol_errors() -> None:
    payload = _payload(_act())
    with pytest.raises(ProtocolError, match="shorter than its"):
        _parse(payload[:10])
    for wrong in (payload[:-1], payload + b"\0"):
        with pytest.raises(ProtocolError, match="payload of"):
            _parse(wrong)
    header = link_wire.ACTIVATION_HEADER.size
    with pytest.raises(ProtocolError, match="not UTF-8"):
        _parse(payload[:header] + b"\xff\xfe" + payload[header + 2 :])


def test_a_batch_over_the_nodes_limit_is_payload_too_large() -> None:
    with pytest.raises(PayloadTooLargeError, match="limit of 4"):
        _parse(_payload(_act()), max_tokens=4)


def test_a_sender_with_positions_that_skip_is_refused_before_anything_is_sent() -> None:
    act = _act()
    skipping = Activation(act.session_id, 3, 2, np.array([0, 1, 3, 4, 5]), act.hidden)
    with pytest.raises(ProtocolError, match="consecutive"):
        link_wire.activation_frame(skipping)


def test_a_sender_with_fewer_positions_than_rows_is_refused() -> None:
    act = _act()
    short = Activation(act.session_id, 3, 2, np.arange(len(act.hidden) - 1), act.hidden)
    with pytest.raises(ProtocolError, match="positions for"):
        link_wire.activation_frame(short)


def test_a_session_id_over_the_nodes_limit_is_refused_before_anything_is_sent() -> None:
    act = _act(session_id="s" * (limits.MAX_SESSION_ID_BYTES + 1))
    with pytest.raises(ProtocolError, match=f"over the {limits.MAX_SESSION_ID_BYTES}"):
        link_wire.activation_frame(act)
