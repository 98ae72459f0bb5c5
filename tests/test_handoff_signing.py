"""Every field of every hand-off message is under the fleet's tag: a message altered in any
one field after it was signed, at any depth, is refused, whether the change is made to the
record or to the proto on the wire.

The fields are never listed here: the tests walk them (``dataclasses.fields`` of the
records, the descriptors of the protos), so a field added later is walked too, and fails
these tests if it is left out of the tag. The last tests drive both services' hand-offs
(a tiny engine, no gRPC) with messages altered after signing.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from decode_service.handoff import DecodeHandoff, HandoffLimits
from engine.constraint import Constraint, ConstraintKind
from engine.errors import DeadlineExceededError, PermissionDeniedError
from engine.kv_layout import KVLayout
from engine.request import RequestTimings, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.transfer.base import KVDescriptor, KVEndpoint
from engine.transfer.canonical import canonical
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.handoff import (
    Ack,
    FirstToken,
    HandoffMessage,
    Phase,
    PrefillEvent,
    PrefillOrder,
    Progress,
    TransferDone,
    message_is_signed,
    message_tag,
    order_is_signed,
    order_tag,
)
from rpc.convert_handoff import (
    ack_from_proto,
    ack_to_proto,
    prefill_event_from_proto,
    prefill_event_to_proto,
    prefill_order_from_proto,
    prefill_order_to_proto,
)
from tests.test_decode_handoff import PARAMS as DECODE_PARAMS
from tests.test_decode_handoff import PROMPT as DECODE_PROMPT
from tests.test_decode_handoff import STALL_S, ScriptedLink
from tests.test_decode_handoff import Rig as DecodeRig
from tests.test_decode_handoff import rig as decode_rig  # noqa: F401 (a fixture)
from tests.test_prefill_handoff import Rig as PrefillRig
from tests.test_prefill_handoff import rig as prefill_rig  # noqa: F401 (a fixture)

KEY = FleetKey(b"the-fleet-secret-of-the-signing-tests")
LEASE = 2**63 + 5  # a lease token in the upper half of uint64, as real ones may be
LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")


def _order() -> PrefillOrder:
    """A signed order with every optional field set and every sampling parameter off its
    default, so each field has a value to alter (or to clear)."""
    endpoint = KVEndpoint("cuda_ipc", "seg-1", "inc-1", LAYOUT, 64, handle=b"\x01ipc-handle")
    params = SamplingParams(
        max_tokens=8,
        temperature=0.7,
        top_k=5,
        top_p=0.5,
        min_p=0.25,
        seed=11,
        min_tokens=1,
        stop_token_ids=(2, 3),
        ignore_eos=True,
        logprobs=2,
        repetition_penalty=1.25,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        output_offset=4,  # a request that moved: its prompt ends with 4 earlier outputs
        # A peer that swapped the constraint would have decode mask by another grammar.
        constraint=Constraint(ConstraintKind.CHOICE, choices=("yes", "no")),
        logit_bias=((5, -100.0), (9, 2.5)),
        prompt_logprobs=2,
        n=2,
    )
    desc = KVDescriptor(endpoint, "r1", (3, 4, 5), epoch=77, lease_token=LEASE)
    order = PrefillOrder("r1", tuple(range(100, 140)), params, desc, timeout_s=12.5)
    return dataclasses.replace(order, mac=order_tag(KEY, order))


def _messages() -> list[HandoffMessage]:
    """One of each message after the order, signed for lease ``LEASE`` of request r1."""
    logprob = TokenLogprob(7, -0.5, 1, [(7, -0.5), (9, -1.5)])
    timings = RequestTimings(*(0.125 * (i + 1) for i in range(7)))
    messages: list[HandoffMessage] = [
        Progress(Phase.PREFILLING, 17),
        FirstToken(7, logprob, 16, "sender-1", prompt_logprobs=(logprob, logprob)),
        TransferDone(123, 77, 4096, timings=timings),
        Ack(False, "checksum mismatch"),
    ]
    return [dataclasses.replace(m, mac=message_tag(KEY, "r1", LEASE, m)) for m in messages]


# -- records -------------------------------------------------------------------------------


def test_the_canonical_encoding_tells_values_apart_and_not_their_wire_form() -> None:
    # What a proto double or a repeated field gives back encodes as what was sent.
    assert canonical(0) == canonical(0.0) == canonical(-0.0)
    assert canonical((1, 2)) == canonical([1.0, 2]) and canonical(()) == canonical([])
    assert canonical((1, 2**70)) == canonical([1.0, 2**70])
    # Different values never encode alike.
    distinct = [None, 0, 1, 0.5, True, False, "1", b"1", "", b"", (), (1,), ((1,),), (1, 2),
                (2, 1), (True,), (0.5,), ("a", "b"), ("ab",), Phase.QUEUED, Phase.PREFILLING,
                Progress(Phase.QUEUED, 1), Progress(Phase.QUEUED, 2)]  # fmt: skip
    assert len({canonical(v) for v in distinct}) == len(distinct)
    # A value it does not know is an error, never silently left out of a tag.
    with pytest.raises(TypeError, match="cannot encode"):
        canonical(Progress(Phase.QUEUED, object()))  # type: ignore[arg-type]


def test_a_tag_survives_the_wire_for_a_record_built_with_ints() -> None:
    # Decode builds temperature=0 (an int); the prefill worker reads 0.0 from the proto.
    order = _order()
    order = dataclasses.replace(order, params=SamplingParams(temperature=0, top_p=1))
    signed = dataclasses.replace(order, mac=order_tag(KEY, order))
    read = prefill_order_from_proto(prefill_order_to_proto(signed))
    assert isinstance(read.params.temperature, float) and order_is_signed(KEY, read)


def _leaves(record: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any, bool]]:
    """(path, value, may be None) of every value that is not itself a record, at every
    depth of ``record``."""
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, (*path, field.name))
        else:
            yield (*path, field.name), value, "None" in str(field.type)


def _other_values(value: Any, optional: bool) -> list[Any]:
    """Values of the same kind as ``value`` but different (None too, when allowed)."""
    others: list[Any]
    if isinstance(value, bool):
        others = [not value]
    elif isinstance(value, enum.Enum):
        others = [m for m in type(value) if m is not value]
    elif isinstance(value, int):
        others = [value + 1, value - 1]
    elif isinstance(value, float):
        others = [value + 0.25, -value]
    elif isinstance(value, str):
        others = [value + "x", ""]
    elif isinstance(value, bytes):
        others = [value + b"x", b""]
    elif dataclasses.is_dataclass(value):  # a record inside a sequence: alter its first field
        name = dataclasses.fields(value)[0].name
        others = [
            dataclasses.replace(value, **{name: _other_values(getattr(value, name), False)[0]})
        ]
    elif isinstance(value, list | tuple):
        assert value, "give every sequence an item, so its items can be altered"
        first = _other_values(value[0], False)[0]
        others = [value[:-1], [*value, value[-1]], [first, *value[1:]]]
        others = [type(value)(o) for o in others]
    else:
        raise AssertionError(f"no other values known for {value!r}")
    return [*others, None] if optional and value is not None else others


def _replaced(record: Any, path: tuple[str, ...], value: Any) -> Any:
    """``record`` with the field at ``path`` set to ``value``, skipping validation (an
    attacker's bytes need not be a valid record)."""
    out = copy.copy(record)
    inner = value if len(path) == 1 else _replaced(getattr(record, path[0]), path[1:], value)
    object.__setattr__(out, path[0], inner)
    return out


def _alterations(record: Any) -> Iterator[tuple[str, Any]]:
    """(dotted path, ``record`` altered in that one field) for every field but the tag."""
    for path, value, optional in _leaves(record):
        if path == ("mac",):
            continue
        for other in _other_values(value, optional):
            if other == value:  # an empty string's "other" empty string
                continue
            yield ".".join(path), _replaced(record, path, other)


def test_every_field_of_an_order_is_under_its_tag() -> None:
    order = _order()
    assert order_is_signed(KEY, order)
    assert not order_is_signed(KEY, dataclasses.replace(order, mac=b""))
    assert not order_is_signed(FleetKey(b"another-fleet-secret-0123"), order)
    walked = set()
    for path, altered in _alterations(order):
        walked.add(path)
        assert not order_is_signed(KEY, altered), f"order.{path} is not under the tag"
    # The walk reached what the order commits a prefill worker to (a check of the walk).
    assert walked >= {
        "request_id",
        "prompt_token_ids",
        "timeout_s",
        "params.temperature",
        "params.seed",
        "params.stop_token_ids",
        "params.logprobs",
        "descriptor.request_id",
        "descriptor.block_ids",
        "descriptor.epoch",
        "descriptor.lease_token",
        "descriptor.endpoint.kind",
        "descriptor.endpoint.address",
        "descriptor.endpoint.incarnation",
        "descriptor.endpoint.num_blocks",
        "descriptor.endpoint.handle",
        "descriptor.endpoint.layout.dtype",
        "descriptor.endpoint.layout.num_layers",
    }
    assert walked >= {
        f"params.{f.name}" for f in dataclasses.fields(SamplingParams) if f.name != "constraint"
    }
    assert walked >= {
        "params.constraint.kind",
        "params.constraint.spec",
        "params.constraint.choices",
    }


@pytest.mark.parametrize("index", range(4), ids=["progress", "first_token", "done", "ack"])
def test_every_field_of_every_stream_message_is_under_its_tag(index: int) -> None:
    message = _messages()[index]
    assert message_is_signed(KEY, "r1", LEASE, message)
    assert not message_is_signed(KEY, "r1", LEASE, dataclasses.replace(message, mac=b""))
    # Bound to its request and lease: not good for any other.
    assert not message_is_signed(KEY, "r2", LEASE, message)
    assert not message_is_signed(KEY, "r1", LEASE + 1, message)
    walked = set()
    for path, altered in _alterations(message):
        walked.add(path)
        assert not message_is_signed(KEY, "r1", LEASE, altered), f"{path} is not under the tag"
    assert walked == {".".join(path) for path, _, _ in _leaves(message) if path != ("mac",)}, (
        "every field was altered"
    )


# -- the wire ------------------------------------------------------------------------------

# Proto fields the readers never read: outside every tag, and nothing acts on them (the
# test below proves the second half, so a reader that starts using one fails it).
UNREAD = {"transfer_complete.request_id", "first_token.finish_reason", "ack.request_id"}


def _wire_alterations(root: Message, top: str) -> Iterator[tuple[str, Message]]:
    """(dotted path, a copy of ``root`` with that one field altered) for every field of
    ``root.<top>`` at every depth, each altered in every way that stays on the wire."""
    for path in _wire_paths(getattr(root, top), (top,)):
        for alter in _wire_changes(root, path):
            altered = copy.deepcopy(root)
            alter(altered)
            if altered == root:  # clearing an unset member of a oneof changes nothing
                continue
            yield ".".join(str(p) for p in path), altered


def _wire_paths(msg: Message, path: tuple[str | int, ...]) -> Iterator[tuple[str | int, ...]]:
    for field in msg.DESCRIPTOR.fields:
        here = (*path, field.name)
        yield here
        if field.message_type is None or _is_map(field):
            continue
        if field.is_repeated:
            items = getattr(msg, field.name)
            assert items, f"give {'.'.join(map(str, here))} an item, so its fields are walked"
            yield from _wire_paths(items[0], (*here, 0))
        else:
            yield from _wire_paths(getattr(msg, field.name), here)


def _wire_changes(root: Message, path: tuple[str | int, ...]) -> list[Callable[[Message], None]]:
    """The ways to alter the field at ``path`` of ``root`` (each a function on a copy)."""

    def parent(msg: Message) -> Message:
        for step in path[:-1]:
            msg = msg[step] if isinstance(step, int) else getattr(msg, step)  # type: ignore[index]
        return msg

    name = str(path[-1])
    field = parent(root).DESCRIPTOR.fields_by_name[name]
    value = getattr(parent(root), name)
    changes: list[Callable[[Message], None]] = []

    def do(change: Callable[[Message], None]) -> None:
        changes.append(lambda msg: change(parent(msg)))

    if _is_map(field):  # scalar values (logit_bias): drop a key, add one, change a value
        assert len(value), f"give {'.'.join(map(str, path))} an entry"
        key = min(value)
        do(lambda m: getattr(m, name).pop(key))
        do(lambda m: getattr(m, name).__setitem__(max(value) + 1, value[key]))
        do(lambda m: getattr(m, name).__setitem__(key, value[key] + 0.25))
        return changes
    if field.is_repeated:
        assert len(value), f"give {'.'.join(map(str, path))} an item"
        do(lambda m: getattr(m, name).pop())
        if field.message_type is None:
            do(lambda m: getattr(m, name).append(getattr(m, name)[-1]))
            first = _other_scalars(field, value[0])[0]
            do(lambda m: getattr(m, name).__setitem__(0, first))
        else:
            do(lambda m: getattr(m, name).add().CopyFrom(getattr(m, name)[-1]))
        return changes
    if field.has_presence:
        do(lambda m: m.ClearField(name))
    if field.message_type is None:
        for other in _other_scalars(field, value):
            do(functools.partial(_set, name=name, value=other))
    return changes


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _set(msg: Message, *, name: str, value: Any) -> None:
    setattr(msg, name, value)


def _other_scalars(field: FieldDescriptor, value: Any) -> list[Any]:
    """Other values of a scalar field's type: every other member of an enum."""
    if field.enum_type is not None:
        return [v.number for v in field.enum_type.values if v.number != value]
    if field.type == FieldDescriptor.TYPE_BOOL:
        return [not value]
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return [value + 0.25]
    if field.type == FieldDescriptor.TYPE_STRING:
        return [value + "x"]
    if field.type == FieldDescriptor.TYPE_BYTES:
        return [value + b"x"]
    return [value + 1]  # the integers: every value here is far from its type's limit


def test_every_field_of_an_order_on_the_wire_is_under_its_tag() -> None:
    order = _order()
    wire = prefill_order_to_proto(order)
    assert prefill_order_from_proto(wire) == order  # the tag survives the wire
    walked = set()
    for path, altered in _wire_alterations(wire, "request"):
        walked.add(path)
        try:
            read = prefill_order_from_proto(altered)
        except ValueError:
            continue  # refused as it is read
        assert not order_is_signed(KEY, read), f"{path} is not under the tag"
    assert {"request.kv.handle", "request.kv.transport", "request.timeout_s"} <= walked
    assert {"request.sampling_params.temperature", "request.kv.layout.dtype"} <= walked
    assert {
        "request.sampling_params.choice.choices",
        "request.sampling_params.json_schema",
        "request.sampling_params.regex",
    } <= walked


@pytest.mark.parametrize("index", range(4), ids=["progress", "first_token", "done", "ack"])
def test_every_field_of_a_stream_message_on_the_wire_is_under_its_tag(index: int) -> None:
    message = _messages()[index]
    wire: Message
    read: Callable[[Any], HandoffMessage | None]
    if isinstance(message, Ack):
        wire, top, read = ack_to_proto("r1", message), "ack", ack_from_proto
    else:
        wire = prefill_event_to_proto("r1", message)
        top, read = str(wire.WhichOneof("message")), prefill_event_from_proto
    assert read(wire) == message  # the tag survives the wire
    for path, altered in _wire_alterations(wire, top):
        try:
            got = read(altered)
        except ValueError:
            continue  # refused as it is read
        if path in UNREAD:
            assert got == message, f"{path} is not under the tag, yet it is read"
            continue
        assert got is not None and not message_is_signed(KEY, "r1", LEASE, got), (
            f"{path} is not under the tag"
        )


# -- the services --------------------------------------------------------------------------


async def _acks(*items: Ack | None) -> AsyncIterator[Ack | None]:
    for item in items:
        yield item


async def test_prefill_refuses_altered_orders_and_acks_and_signs_every_event(
    prefill_rig: PrefillRig,  # noqa: F811
) -> None:
    rig, handoff = prefill_rig, prefill_rig.handoff(KEY)
    order = rig.order("a1")
    signed = dataclasses.replace(order, mac=order_tag(KEY, order))
    # A sampling parameter, then the cuda_ipc handle, altered after signing.
    steps = rig.engine.stats().num_steps
    for altered in (
        dataclasses.replace(signed, params=dataclasses.replace(order.params, temperature=1.0)),
        dataclasses.replace(
            signed,
            descriptor=dataclasses.replace(
                order.descriptor,
                endpoint=dataclasses.replace(order.descriptor.endpoint, handle=b"x"),
            ),
        ),
    ):
        with pytest.raises(PermissionDeniedError, match="does not carry the fleet's secret"):
            async for _ in handoff.run(altered, _acks(), None):
                pass
    assert rig.engine.stats().num_steps == steps, "an altered order must not run"
    # Signed: every event is signed for this lease; an ack altered after signing is refused.
    lease = order.descriptor.lease_token
    ack = Ack(False, "checksum mismatch")
    ack = dataclasses.replace(ack, mac=message_tag(KEY, "a1", lease, ack), ok=True)
    events: list[PrefillEvent] = []
    with pytest.raises(PermissionDeniedError, match="the ack does not carry"):
        async for event in handoff.run(signed, _acks(ack), None):
            events.append(event)
    assert {type(e) for e in events} >= {Progress, FirstToken, TransferDone}
    assert all(message_is_signed(KEY, "a1", lease, e) for e in events)
    await rig.settle()


async def test_the_orders_signed_time_limit_bounds_the_prefill_worker(
    prefill_rig: PrefillRig,  # noqa: F811
) -> None:
    rig, handoff = prefill_rig, prefill_rig.handoff(KEY)
    order = dataclasses.replace(rig.order("t1"), timeout_s=0.01)
    signed = dataclasses.replace(order, mac=order_tag(KEY, order))
    # The call itself has no deadline: the order's is the one that ends the transfer.
    with pytest.raises(DeadlineExceededError):
        async for _ in handoff.run(signed, _acks(Ack(True)), None):
            pass
    await rig.settle()


class _SigningPrefill(ScriptedLink):
    """A prefill worker of the fleet: signs every event it sends, and ``tamper`` then
    alters it on the way (a man in the middle)."""

    def __init__(self, rig: DecodeRig, tamper: Callable[[PrefillEvent], PrefillEvent]) -> None:
        super().__init__(rig.transfer)
        self._tamper = tamper

    async def receive(self) -> PrefillEvent | None:
        event = await super().receive()
        order = self.sent[0]
        if event is None or not isinstance(order, PrefillOrder):
            return event
        tag = message_tag(KEY, order.request_id, order.descriptor.lease_token, event)
        return self._tamper(dataclasses.replace(event, mac=tag))


def _decode_handoff(
    rig: DecodeRig, links: list[_SigningPrefill], tamper: Callable[[PrefillEvent], PrefillEvent]
) -> DecodeHandoff:
    def open_link(address: str, remaining: float | None, trace_context: object) -> _SigningPrefill:
        links.append(_SigningPrefill(rig, tamper))
        return links[-1]

    return DecodeHandoff(rig.engine, rig.inbox, HandoffLimits(STALL_S), open_link, KEY)


async def test_decode_acts_on_no_event_altered_after_signing(
    decode_rig: DecodeRig,  # noqa: F811
) -> None:
    rig = decode_rig
    links: list[_SigningPrefill] = []

    def new_sender(event: PrefillEvent) -> PrefillEvent:
        if isinstance(event, FirstToken):
            return dataclasses.replace(event, sender_incarnation="someone-else")
        return event

    handoff = _decode_handoff(rig, links, new_sender)
    with pytest.raises(PermissionDeniedError, match="sent a FirstToken without the fleet's"):
        await _collect(handoff.run("m1", DECODE_PROMPT, DECODE_PARAMS, "p:1", None))
    assert not any(isinstance(m, Ack) and m.ok for m in links[0].sent), "never acked"
    await rig.settle()

    def new_checksum(event: PrefillEvent) -> PrefillEvent:
        if isinstance(event, TransferDone):
            return dataclasses.replace(event, checksum=event.checksum ^ 1)
        return event

    handoff = _decode_handoff(rig, links, new_checksum)
    with pytest.raises(PermissionDeniedError, match="sent a TransferDone without the fleet's"):
        await _collect(handoff.run("m2", DECODE_PROMPT, DECODE_PARAMS, "p:1", None))
    await rig.settle()


async def test_decode_signs_the_order_with_its_time_limit_and_the_ack(
    decode_rig: DecodeRig,  # noqa: F811
) -> None:
    rig = decode_rig
    links: list[_SigningPrefill] = []
    handoff = _decode_handoff(rig, links, lambda event: event)
    deadline = time.monotonic() + 60
    tokens = await _collect(handoff.run("g1", DECODE_PROMPT, DECODE_PARAMS, "p:1", deadline))
    assert len(tokens) == DECODE_PARAMS.max_tokens
    order, ack = links[0].sent
    assert isinstance(order, PrefillOrder) and order_is_signed(KEY, order)
    assert order.timeout_s is not None and 50 < order.timeout_s <= 60
    assert isinstance(ack, Ack) and ack.ok
    assert message_is_signed(KEY, "g1", order.descriptor.lease_token, ack)
    await rig.settle()


async def _collect(outputs: AsyncIterator[Any]) -> list[int]:
    tokens: list[int] = []
    async for out in outputs:
        tokens.extend(out.new_token_ids)
    return tokens
