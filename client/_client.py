"""The client a prefill or decode worker holds: contracts, push, pull (with confirm), cancel.

    c = HandoffClient("127.0.0.1:50051")
    c.push("demo-hybrid", "req-42", position=17, tensors={name: array, ...})   # prefill side
    h = c.pull("demo-hybrid", "req-42", timeout=30)                             # decode side

What each call guarantees afterwards:
- `push` returns only when the broker has checked every byte and made the hand-off visible; if it raises, the
  broker holds nothing of this push. The arrays are checked first with the contract's own rules and never cast.
- `pull` returns only arrays that are whole, checksummed chunk by chunk, match the hand-off's digest, and whose
  claim the broker has confirmed; the broker has then forgotten the hand-off. If it raises before the confirm,
  the hand-off stays with the broker for the next pull. The arrays own their memory.
- Every failure is a `HandoffError` subclass, the same one whichever side found the fault.

Only grpcio, protobuf, numpy, ml_dtypes, crc32c and grpcio-status are needed here: a decode worker does not install
the broker's own dependencies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Self, TypeVar

import grpc
import numpy as np

from ._arguments import as_arrays, checked_position
from ._calls import (
    CHANNEL_OPTIONS,
    DEFAULT_RETRY,
    MAX_MESSAGE_BYTES,
    NO_RETRY,
    RetryPolicy,
    make_channel,
    retryable_pull,
    retryable_push,
    tls_hint,
)
from ._lane_choice import LaneOffers, connections_for
from ._produced import CheckedState, is_produced, producing
from ._pulls import PullAttempts, PulledTensors, destinations
from ._pushes import PushAttempts, PushResult
from ._status import BrokerStatus
from .protocol.contract import Contract, Handoff, cut_to_filled
from .protocol.errors import BrokerUnavailable, FingerprintMismatch, HandoffError, from_rpc_error
from .protocol.lane import MAX_CONNECTIONS, new_capability
from .protocol.limits import DEFAULT_CHUNK_BYTES
from .protocol.messages import handoff_pb2 as pb
from .protocol.shards import Shard, as_shard, view
from .protocol.tickets import make_ticket, pulled_incarnation, ticket_for
from .protocol.wire import (
    contract_from_proto,
    decode_pull_response,
    identity,
    message_classes,
    method_path,
    shard_to_proto,
)

__all__ = [  # (the names other modules and tests import from here)
    "CHANNEL_OPTIONS", "DEFAULT_CHUNK_BYTES", "DEFAULT_RETRY", "DEFAULT_TIMEOUT", "MAX_MESSAGE_BYTES", "NO_RETRY",
    "BrokerClient", "PushResult", "RetryPolicy", "make_channel", "retryable_pull", "retryable_push",
]  # fmt: skip

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0
"""Seconds a call may take, end to end, unless the caller says otherwise."""

T = TypeVar("T")


class BrokerClient:
    """A connection to one broker. Thread-safe: one client may serve many concurrent pushes and pulls.

    Callers make one as `HandoffClient(target)` (handoff_client._handoff), which makes a FleetClient instead when the
    target names several brokers; the fleet (handoff_client.fleet) makes one of these for each broker it uses.
    """

    def __init__(
        self,
        target: str,
        *,
        chunk_bytes: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        credentials: grpc.ChannelCredentials | None = None,
        options: tuple[tuple[str, object], ...] = (),
        retry: RetryPolicy = DEFAULT_RETRY,
        retry_unreachable: bool = True,
        token: str | None = None,
        tls_root_certificates: bytes | None = None,
        tls_certificate_chain: bytes | None = None,
        tls_private_key: bytes | None = None,
        tls_server_name: str | None = None,
        lanes: bool = True,
        shared_memory: bool = True,
        lane_connections: int = 1,
    ) -> None:
        """`token` is sent as `authorization: Bearer <token>` on every call. The tls_* arguments (PEM bytes) make
        the channel TLS: the CA to trust, and for mutual TLS this client's certificate and key; `tls_server_name`
        overrides the name checked against the broker's certificate. `credentials` takes any other gRPC kind.
        `lanes=False` keeps every hand-off's bytes on the gRPC streams even where the broker offers lanes
        (docs/lanes.md), which large hand-offs otherwise take: its shared-memory lane from the broker's own host,
        else its TCP lane; `shared_memory=False` takes the TCP lane even on the broker's host.
        `lane_connections` stripes each call's TCP lane over that many connections (at most the lane's
        `max_connections`): worth it only on links whose bandwidth-delay product exceeds one TCP window.
        `chunk_bytes` is the bytes a pushed chunk carries, on every path; by default DEFAULT_CHUNK_BYTES on the
        streams and, on a lane, a sixteenth of the hand-off from that up to 4 MiB (_lane_choice.frame_bytes).
        `retry_unreachable=False`: a push or pull whose broker cannot be reached (BrokerUnavailable itself, not
        BROKER_BUSY or a broken lane) is not retried at it (a fleet's per-broker clients: the next broker is tried)."""
        if not 0 < lane_connections <= MAX_CONNECTIONS:
            raise ValueError(f"lane_connections must be in 1..{MAX_CONNECTIONS}, got {lane_connections}")
        if chunk_bytes is not None and not 0 < chunk_bytes <= MAX_MESSAGE_BYTES - 1024:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_MESSAGE_BYTES - 1024}, got {chunk_bytes}")
        self.target = target
        self.chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES  # a pushed chunk's bytes on the streams
        self.chunk_bytes_chosen = chunk_bytes is not None  # ... and on the lanes, else a size for each (frame_bytes)
        self.timeout = timeout
        self.retry = retry
        self.retry_unreachable = retry_unreachable
        self.lane_connections = lane_connections
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._plaintext = credentials is None and not (tls_root_certificates or tls_certificate_chain)
        self._closed = False
        self._channel = make_channel(
            target, CHANNEL_OPTIONS + tuple(options), credentials, tls_root_certificates=tls_root_certificates,
            tls_certificate_chain=tls_certificate_chain, tls_private_key=tls_private_key,
            tls_server_name=tls_server_name,
        )  # fmt: skip
        self._contracts: dict[str, Contract] = {}
        unary = self._unary
        self._list, self._get, self._confirm = unary("ListContracts"), unary("GetContract"), unary("ConfirmHandoff")
        self._status, self._progress, self._cancel = (
            unary("GetStatus"),
            unary("GetPushProgress"),
            unary("CancelHandoff"),
        )
        get_lanes = unary("GetLanes")
        self.lane_offers = LaneOffers(lambda model: get_lanes(pb.LanesRequest(model=model), timeout=self.timeout,
                                                            metadata=self._metadata),
                                      lanes=lanes, shared_memory=shared_memory)  # fmt: skip
        # The two streams carry chunk frames, encoded and decoded by hand (protocol/frames.py).
        self._push = self._channel.stream_unary(
            method_path("PushHandoff"), request_serializer=identity, response_deserializer=pb.PushResponse.FromString
        )
        self._pull = self._channel.unary_stream(
            method_path("PullHandoff"),
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=decode_pull_response,
        )

    def _unary(self, name: str) -> grpc.UnaryUnaryMultiCallable:
        request, response = message_classes(name)
        return self._channel.unary_unary(
            method_path(name), request_serializer=request.SerializeToString, response_deserializer=response.FromString
        )

    def close(self) -> None:
        self._closed = True  # (a call the close cancelled is not retried on the closed channel)
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- contracts ----------------------------------------------------------------------------------------------------

    def list_contracts(self, *, timeout: float | None = None) -> list[Contract]:
        """The contracts the broker serves."""
        response = self._call(self._list, pb.ListContractsRequest(), timeout)
        contracts = [self._accept_contract(message) for message in response.contracts]
        return contracts

    def get_contract(self, model: str, *, timeout: float | None = None, refresh: bool = False) -> Contract:
        """The broker's contract for `model`, fetched once and kept."""
        if refresh or model not in self._contracts:
            self._accept_contract(self._call(self._get, pb.GetContractRequest(model=model), timeout))
        return self._contracts[model]

    def _accept_contract(self, message: pb.Contract) -> Contract:
        contract = contract_from_proto(message)
        if contract.fingerprint != message.fingerprint:
            # The broker computes fingerprints differently: a different release. Refuse rather than guess.
            raise FingerprintMismatch(contract.model, message.fingerprint, contract.fingerprint)
        self._contracts[contract.model] = contract
        return contract

    # -- prefill side -------------------------------------------------------------------------------------------------

    def push(
        self,
        model: str,
        handoff_id: str,
        position: int,
        tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
        *,
        timeout: float | None = None,
        ttl: float | None = None,
        wait_for_room: bool = True,
        resumable: bool = False,
        shard: Shard | tuple[int, int] | None = None,
        drop_extra: bool = False,
    ) -> PushResult:
        """Hand the carried tensors after `position` tokens to the broker under `handoff_id`.

        A tensor the contract does not carry is refused by name (UnknownTensor), as the broker would; `drop_extra=True`
        leaves such tensors behind. The carried ones must be exactly as declared, except that a tensor
        whose rows are positions (`Carried.rows_are_positions`) may be given either as the rows `position` tokens
        filled, `(min(position, rows), cols)`, or as the whole cache `(rows, cols)`: either way only the filled rows
        are sent, and the puller gets the same hand-off. `ttl` shortens how
        long the hand-off may wait for its decoder; `wait_for_room=False` fails at once with CapacityExhausted
        when the broker is full, instead of waiting (up to `timeout`) for room. `resumable=True` asks the broker
        to keep what arrived if the stream breaks, and a retry then sends only the rest.

        `shard=(rank, tp)`: this is rank `rank` of a prefill engine of `tp` ranks, and `tensors` are its own
        arrays (its heads of each split tensor, `(rows, heads/tp × head_dim)`; rank 0 also the tensors not split).
        Every rank pushes under the same id, concurrently; the hand-off is pullable once all have. A sharded push
        that breaks is resumed like a whole one, rank by rank.

        `tensors` may also be an iterable of (name, array) pairs still being made, a generator copying them out of
        an engine's pages, say: it runs on a thread of its own, and the push sends each tensor as soon as it is made
        (handoff_client._produced). Each array is checked as it is sent; an array that fails, or the iterable
        raising, ends the push with that error and the broker keeps nothing (a resumable push is cancelled: push
        again under a new id). When `push` returns or raises, the iterable has stopped.
        """
        position = checked_position(model, position)
        arrays = None if is_produced(tensors) else as_arrays(model, tensors)
        part = as_shard(model, shard)
        contract = view(self.get_contract(model).at(position), part, pushing=True)
        options = {"ttl": ttl, "wait_for_room": wait_for_room, "resumable": resumable}
        if arrays is not None:
            handoff = contract.take(position, cut_to_filled(contract, arrays), drop_extra=drop_extra)
            return self._push_attempts(contract, handoff_id, handoff, part, timeout, **options)
        with producing(model, tensors) as made:
            made.check_first()  # (an iterable of the wrong things is refused before the broker is asked)
            handoff = Handoff(position, CheckedState(made, contract, drop_extra=drop_extra))
            return self._push_attempts(contract, handoff_id, handoff, part, timeout, **options)

    def _push_attempts(
        self, contract: Contract, handoff_id: str, handoff: Handoff, part: Shard, timeout: float | None, **options: Any
    ) -> PushResult:
        attempts = PushAttempts(self, contract, handoff_id, handoff, part, **options)
        response = self._with_retries(attempts.run, self._here(retryable_push), timeout)
        ticket = make_ticket(self.target, contract.model, handoff_id, contract.fingerprint, response.incarnation)
        return PushResult(
            response.handoff_id, response.bytes, response.chunks, response.digest, response.duplicate, ticket
        )

    def push_progress(
        self,
        model: str,
        handoff_id: str,
        *,
        timeout: float | None = None,
        shard: Shard | tuple[int, int] | None = None,
    ) -> pb.PushProgress:
        """Which bytes of a push under way, or broken and kept, the broker holds (of one rank's part, with `shard`)."""
        request = pb.PushProgressRequest(
            model=model, handoff_id=handoff_id, shard=shard_to_proto(as_shard(model, shard))
        )
        return self._call(self._progress, request, timeout)

    @property
    def lanes(self) -> bool:
        """Whether this client takes the broker's lanes at all (`lanes=False`: every hand-off on the streams)."""
        return self.lane_offers.lanes

    def lane(self, nbytes: int | None = None, model: str = "") -> pb.Lane | None:
        """The lane a hand-off of `nbytes` takes (None: whichever a large one would), or None for the streams
        (_lane_choice.LaneOffers.lane)."""
        return self.lane_offers.lane(nbytes, model)

    # -- decode side --------------------------------------------------------------------------------------------------

    def pull(
        self,
        model: str,
        handoff_id: str,
        *,
        timeout: float | None = None,
        ticket: str | None = None,
        shard: Shard | tuple[int, int] | None = None,
        into: Mapping[str, np.ndarray] | None = None,
        wait_for_push: float | None = None,
    ) -> Handoff:
        """Claim the hand-off (waiting up to `timeout`, or `wait_for_push` s if less, for its push to begin),
        receive it whole, verify it, confirm it.

        The arrays are the hand-off's: a tensor whose rows are positions comes as the rows its position filled,
        `(min(position, rows), cols)`. A `ticket` (from the push) is checked to name this hand-off and this
        contract. `shard=(rank, tp)`: this is rank `rank` of a decode engine of `tp` ranks; it receives its heads of
        each split tensor as contiguous `(rows, heads/tp × head_dim)` arrays and every tensor not split, whatever TP
        size pushed it.

        `into` names arrays the decoder already owns (its preallocated cache buffers), one per tensor it receives,
        of the declared shape and dtype, C-contiguous and writable: the bytes land there and nothing is allocated.
        Of a tensor whose rows are positions only the first rows, those the position filled, are written (the
        returned array is that view of them); the rest are left as they were. What they hold is meaningless unless
        the pull returns."""
        self._check_ticket(model, handoff_id, ticket)
        into = None if into is None else as_arrays(model, into, "into")
        attempts = PullAttempts(self, model, handoff_id, as_shard(model, shard), into, wait_for_push, ticket)
        return self._with_retries(attempts.run, self._here(attempts.retryable), timeout)

    def pull_tensors(
        self,
        model: str,
        handoff_id: str,
        *,
        timeout: float | None = None,
        supersedes: int = 0,
        shard: Shard | tuple[int, int] | None = None,
        into: Mapping[str, np.ndarray] | None = None,
        wait_for_push: float | None = None,
        lanes: bool = True,
        ticket: str | None = None,
    ) -> PulledTensors:
        """Claim the hand-off and yield `(carried, array)` as each tensor arrives whole, for a decoder that starts
        on layer 0 while later layers are still on the wire (the broker streams a push still under way).

        Nothing yielded may be kept unless the iteration ends normally: only then has every chunk been checked
        against the digest of a push that passed every check, and the claim been confirmed (`.handoff` is then
        the whole hand-off). If it raises — PushAborted when the push failed — discard what was yielded.
        Not retried: the caller has already seen part of it. `shard` and `into` as for `pull`; the arrays yielded
        are of the filled shape, as `pull` returns them. `lanes=False`: the chunks on the stream, even where the
        broker offers a lane. A `ticket` is checked as `pull` checks it.
        """
        incarnation = self._check_ticket(model, handoff_id, ticket)  # (the PullRequest fields it makes)
        part = as_shard(model, shard)
        declared = self.get_contract(model)
        deadline = self.timeout if timeout is None else timeout
        wire_shard = shard_to_proto(part)
        lane = self.lane(model=model) if lanes else None
        request = pb.PullRequest(
            model=model,
            handoff_id=handoff_id,
            supersedes=supersedes,
            shard=wire_shard,
            wait_seconds=wait_for_push or 0.0,
            lane_capability=new_capability() if lane is not None else b"",
            lane_kind=lane.kind if lane is not None else pb.LANE_KIND_UNSPECIFIED,
            lane_connections=connections_for(lane, self.lane_connections) if lane is not None else 0,
            **incarnation,
        )
        into = None if into is None else as_arrays(model, into, "into")
        arrays = destinations(view(declared, part, pushing=False), into)  # checked before the claim
        stream = self._pull(request, timeout=deadline, metadata=self._metadata)
        return PulledTensors(self, declared, part, handoff_id, stream, deadline, arrays, request)

    def _check_ticket(self, model: str, handoff_id: str, ticket: str | None) -> dict[str, str | bool]:
        """A ticket must name this hand-off and the contract this broker serves for the model; the broker
        incarnation it names, as the PullRequest fields that ask the broker to be it ({}: none, or no ticket)."""
        fields = ticket_for(ticket, model, handoff_id) if ticket is not None else {}
        if fields and fields["f"] != (served := self.get_contract(model).fingerprint):
            raise FingerprintMismatch(model, served, fields["f"])
        return pulled_incarnation(fields)

    def _confirm_claim(
        self, model: str, handoff_id: str, claim: int, timeout: float, shard: pb.Shard | None = None
    ) -> None:
        request = pb.ConfirmRequest(model=model, handoff_id=handoff_id, claim=claim, shard=shard)
        self._with_retries(lambda remaining: self._call(self._confirm, request, remaining), retryable_push, timeout)

    def cancel(self, model: str, handoff_id: str, *, timeout: float | None = None) -> bool:
        """Free the hand-off wherever it is (router abort); True if there was one to free."""
        return self._call(self._cancel, pb.CancelRequest(model=model, handoff_id=handoff_id), timeout).cancelled

    def status(self, *, timeout: float | None = None) -> BrokerStatus:
        """What the broker holds now: hand-offs by state, resident and maximum bytes, the oldest's age."""
        return BrokerStatus.from_proto(self._call(self._status, pb.StatusRequest(), timeout))

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object, timeout: float | None) -> object:
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise tls_hint(from_rpc_error(e), self._plaintext) from None

    def _here(self, retryable: Callable[[HandoffError], bool]) -> Callable[[HandoffError], bool]:
        """`retryable`, less a broker that could not be reached where `retry_unreachable` is off (a fleet's brokers'
        clients: the fleet tries the next broker instead of waiting here for a broker that may be frozen)."""
        return retryable if self.retry_unreachable else lambda e: type(e) is not BrokerUnavailable and retryable(e)

    def _with_retries(
        self, attempt: Callable[[float], T], retryable: Callable[[HandoffError], bool], timeout: float | None
    ) -> T:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        delays = self.retry.delays()
        while True:
            try:
                return attempt(max(deadline - time.monotonic(), 0.0))
            except HandoffError as e:
                delay = next(delays, None)
                if self._closed or not retryable(e) or delay is None or time.monotonic() + delay >= deadline:
                    raise tls_hint(e, self._plaintext) from None
                logger.info("retrying in %.3f s after %s: %s", delay, type(e).__name__, e.message)
                time.sleep(delay)
