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
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from ._contract import Carried, Contract, Handoff, TensorSpans, check_array, cut_to_filled
from ._errors import (
    AlreadyClaimed,
    BadChunk,
    BrokerBusy,
    BrokerUnavailable,
    CallCancelled,
    DigestMismatch,
    FingerprintMismatch,
    HandoffError,
    MalformedRequest,
    MissingTensor,
    PushAborted,
    UnknownHandoff,
    WrongLayout,
    from_rpc_error,
)
from ._fleet import FleetClient, is_fleet, make_ticket, ticket_for
from ._frames import ChunkFrame, crc32c, encode_chunk, handoff_digest
from ._shards import Shard, as_shard, view
from ._proto import handoff_pb2 as pb
from ._wire import contract_from_proto, decode_pull_response, identity, message_classes, method_path, shard_to_proto

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = (1 << 20) - 1024
"""Payload bytes per chunk: 1 MiB less room for the frame's few header bytes. Measured end to end on 2-core
machines (benchmarks/bench.py), 512 KiB to 2 MiB cost the least CPU: every copy gRPC's Python layer makes of a frame
stays within a core's 2 MiB L2 cache, where 4 MiB frames spilled and cost ~15 % more CPU in all three processes;
256 KiB paid more per message. Well under gRPC's default 4 MiB message limit, so a peer built from the .proto with
default settings reads every frame."""

DEFAULT_TIMEOUT = 60.0
"""Seconds a call may take, end to end, unless the caller says otherwise."""

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message either side accepts: a chunk of up to this size minus its few header bytes."""

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How the client retries what is safe to retry: exponential backoff with jitter, a bounded number of attempts,
    and never past the call's own timeout.

    Safe: a push that met UNAVAILABLE (the broker drops a broken push at once, and a repeat of a committed one is
    recognised byte for byte and changes nothing); a pull whose stream broke or whose push was aborted (the claim
    goes back to the pool); a confirm (idempotent for its claim); a call refused as BROKER_BUSY (it took nothing).
    Never retried: anything else the broker refused.
    """

    attempts: int = 4
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    multiplier: float = 2.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_backoff
        for _ in range(self.attempts - 1):
            yield random.uniform(delay / 2, delay)
            delay = min(delay * self.multiplier, self.max_backoff)


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(attempts=1)


def retryable_push(error: HandoffError) -> bool:
    """A push is retried only when the broker could not be reached (and is not draining: go elsewhere) or was at
    its limit of concurrent work (it took nothing)."""
    return type(error) in (BrokerUnavailable, BrokerBusy)


def retryable_pull(error: HandoffError) -> bool:
    """A pull is retried when its stream broke or its push was aborted: the hand-off is, or will be, there again;
    or when the broker was at its limit of concurrent work."""
    return type(error) in (BrokerUnavailable, BrokerBusy, CallCancelled, PushAborted)


@dataclass(frozen=True)
class PushResult:
    """What the broker holds after a push."""

    handoff_id: str
    bytes: int
    chunks: int
    digest: str
    duplicate: bool
    ticket: str = ""
    """Names the broker that holds the hand-off: pass it to the decoder, whose pull goes straight there."""


class HandoffClient:
    """A connection to one broker. Thread-safe: one client may serve many concurrent pushes and pulls.

    A target that names several brokers — `"host1:50051,host2:50051"` or `"dns:///brokers.ns.svc:50051"` — makes a
    FleetClient instead (_fleet.py), with the same methods: worker code does not change between one broker and fifty.
    """

    def __new__(cls, target: str, **options: object) -> HandoffClient:
        if cls is HandoffClient and is_fleet(target):
            return FleetClient(target, **options)  # type: ignore[return-value]
        return super().__new__(cls)

    def __init__(
        self,
        target: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        credentials: grpc.ChannelCredentials | None = None,
        options: tuple[tuple[str, object], ...] = (),
        retry: RetryPolicy = DEFAULT_RETRY,
        token: str | None = None,
        tls_root_certificates: bytes | None = None,
        tls_certificate_chain: bytes | None = None,
        tls_private_key: bytes | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        """`token` is sent as `authorization: Bearer <token>` on every call. The tls_* arguments (PEM bytes) make
        the channel TLS: the CA to trust, and for mutual TLS this client's certificate and key; `tls_server_name`
        overrides the name checked against the broker's certificate. `credentials` takes any other gRPC kind."""
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES - 1024:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_MESSAGE_BYTES - 1024}, got {chunk_bytes}")
        self.target = target
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.retry = retry
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
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
        # The two streams carry chunk frames, encoded and decoded by hand (_frames.py).
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
        self._channel.close()

    def __enter__(self) -> HandoffClient:
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
        tensors: Mapping[str, np.ndarray],
        *,
        timeout: float | None = None,
        ttl: float | None = None,
        wait_for_room: bool = True,
        resumable: bool = False,
        shard: Shard | tuple[int, int] | None = None,
    ) -> PushResult:
        """Hand the carried tensors after `position` tokens to the broker under `handoff_id`.

        Extra entries in `tensors` are ignored; the carried ones must be exactly as declared, except that a tensor
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
        """
        part = as_shard(model, shard)
        contract = view(self.get_contract(model).at(position), part, pushing=True)
        handoff = contract.take(position, cut_to_filled(contract, tensors))

        def header(resume: bool) -> bytes:
            message = pb.PushHeader(
                model=model,
                handoff_id=handoff_id,
                position=position,
                fingerprint=contract.fingerprint,
                ttl_seconds=ttl or 0.0,
                no_wait=not wait_for_room,
                resumable=resumable,
                resume=resume,
                shard=shard_to_proto(part),
            )
            return pb.PushRequest(header=message).SerializeToString()

        attempts = [0]

        def attempt(remaining: float) -> pb.PushResponse:
            attempts[0] += 1
            held = self._held(model, handoff_id, remaining, part) if resumable and attempts[0] > 1 else None
            frames = self._push_frames(contract, header(resume=held is not None), handoff, held)
            return self._call(self._push, frames, remaining)

        response = self._with_retries(attempt, retryable_push, timeout)
        ticket = make_ticket(self.target, model, handoff_id, contract.fingerprint)
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

    def _held(
        self, model: str, handoff_id: str, timeout: float, shard: Shard
    ) -> dict[str, list[tuple[int, int]]] | None:
        """What the broker kept of our broken push, or None when there is nothing to resume (push it whole)."""
        try:
            progress = self.push_progress(model, handoff_id, timeout=timeout, shard=shard)
        except UnknownHandoff:
            return None
        if progress.complete:
            return None  # it committed after all: a whole repeat is recognised byte for byte and changes nothing
        return {t.tensor: [(r.offset, r.length) for r in t.received] for t in progress.tensors}

    def _push_frames(
        self, contract: Contract, header: bytes, handoff: Handoff, held: dict[str, list[tuple[int, int]]] | None
    ) -> Iterator[bytes]:
        yield header
        for carried in contract.carried:
            array = np.ascontiguousarray(handoff.state[carried.name])
            payload = memoryview(array.reshape(-1).view(np.uint8))
            for start, end in _missing(carried.nbytes, (held or {}).get(carried.name, [])):
                for offset in range(start, end, self.chunk_bytes):
                    yield encode_chunk(carried.name, offset, payload[offset : min(offset + self.chunk_bytes, end)])

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
        if ticket is not None:
            fields = ticket_for(ticket, model, handoff_id)
            contract = self.get_contract(model)
            if fields["f"] != contract.fingerprint:
                raise FingerprintMismatch(model, contract.fingerprint, fields["f"])

        attempts = _PullAttempts(self, model, handoff_id, as_shard(model, shard), into, wait_for_push)
        return self._with_retries(attempts.run, attempts.retryable, timeout)

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
    ) -> PulledTensors:
        """Claim the hand-off and yield `(carried, array)` as each tensor arrives whole, for a decoder that starts
        on layer 0 while later layers are still on the wire (the broker streams a push still under way).

        Nothing yielded may be kept unless the iteration ends normally: only then has every chunk been checked
        against the digest of a push that passed every check, and the claim been confirmed (`.handoff` is then
        the whole hand-off). If it raises — PushAborted when the push failed — discard what was yielded.
        Not retried: the caller has already seen part of it. `shard` and `into` as for `pull`; the arrays yielded
        are of the filled shape, as `pull` returns them.
        """
        part = as_shard(model, shard)
        declared = self.get_contract(model)
        deadline = self.timeout if timeout is None else timeout
        wire_shard = shard_to_proto(part)
        request = pb.PullRequest(
            model=model,
            handoff_id=handoff_id,
            supersedes=supersedes,
            shard=wire_shard,
            wait_seconds=wait_for_push or 0.0,
        )
        arrays = _destinations(view(declared, part, pushing=False), into)  # checked before the claim
        stream = self._pull(request, timeout=deadline, metadata=self._metadata)
        return PulledTensors(self, declared, part, handoff_id, stream, deadline, arrays)

    def _confirm_claim(
        self, model: str, handoff_id: str, claim: int, timeout: float, shard: pb.Shard | None = None
    ) -> None:
        request = pb.ConfirmRequest(model=model, handoff_id=handoff_id, claim=claim, shard=shard)
        self._with_retries(lambda remaining: self._call(self._confirm, request, remaining), retryable_push, timeout)

    def cancel(self, model: str, handoff_id: str, *, timeout: float | None = None) -> bool:
        """Free the hand-off wherever it is (router abort); True if there was one to free."""
        return self._call(self._cancel, pb.CancelRequest(model=model, handoff_id=handoff_id), timeout).cancelled

    def status(self, *, timeout: float | None = None) -> pb.StatusResponse:
        """What the broker holds now: hand-offs by state, resident and maximum bytes, the oldest's age."""
        return self._call(self._status, pb.StatusRequest(), timeout)

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object, timeout: float | None) -> object:
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

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
                if not retryable(e) or delay is None or time.monotonic() + delay >= deadline:
                    raise
                logger.info("retrying in %.3f s after %s: %s", delay, type(e).__name__, e.message)
                time.sleep(delay)


def make_channel(
    target: str,
    options: tuple[tuple[str, object], ...] = (),
    credentials: grpc.ChannelCredentials | None = None,
    *,
    tls_root_certificates: bytes | None = None,
    tls_certificate_chain: bytes | None = None,
    tls_private_key: bytes | None = None,
    tls_server_name: str | None = None,
) -> grpc.Channel:
    """A channel to `target`: TLS when given a CA or a client certificate (PEM bytes; mutual TLS with both), or
    `credentials` of any other kind; plaintext otherwise. `tls_server_name` overrides the name checked against the
    broker's certificate."""
    if tls_server_name:
        options += (("grpc.ssl_target_name_override", tls_server_name),)
    if credentials is None and (tls_root_certificates or tls_certificate_chain):
        credentials = grpc.ssl_channel_credentials(tls_root_certificates, tls_private_key, tls_certificate_chain)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def _destinations(contract: Contract, into: Mapping[str, np.ndarray] | None) -> list[np.ndarray] | None:
    """The caller's arrays for a pull, in contract order, each checked to take its tensor's bytes in place."""
    if into is None:
        return None
    arrays = []
    for carried in contract.carried:
        array = into.get(carried.name)
        if array is None:
            raise MissingTensor(contract.model, carried.name)
        check_array(contract.model, carried, array)
        if not (array.flags.c_contiguous and array.flags.writeable):
            raise WrongLayout(contract.model, carried.name, carried.layout(), "an array that is not C-contiguous "
                              "and writable, which the pull cannot fill in place")  # fmt: skip
        arrays.append(array)
    return arrays


def _missing(size: int, held: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The [start, end) ranges of [0, size) that the sorted, disjoint `held` (offset, length) ranges leave out."""
    at = 0
    for offset, length in held:
        if offset > at:
            yield at, offset
        at = max(at, offset + length)
    if at < size:
        yield at, size


class _PullAttempts:
    """Successive attempts at one pull. A retry names the claim its broken predecessor held, so the broker hands it
    over at once; and after a break, ALREADY_CLAIMED may be that very claim, not yet noticed dead: retry it too."""

    def __init__(
        self,
        client: HandoffClient,
        model: str,
        handoff_id: str,
        shard: Shard,
        into: Mapping[str, np.ndarray] | None,
        wait_for_push: float | None,
    ) -> None:
        self.client = client
        self.model = model
        self.handoff_id = handoff_id
        self.shard = shard
        self.into = into
        self.wait_for_push = wait_for_push
        self.claim = 0
        self.broke = False

    def run(self, timeout: float) -> Handoff:
        tensors = self.client.pull_tensors(self.model, self.handoff_id, timeout=timeout, supersedes=self.claim,
                                           shard=self.shard, into=self.into, wait_for_push=self.wait_for_push)  # fmt: skip
        try:
            for _ in tensors:
                pass
            return tensors.handoff
        except HandoffError as e:
            self.broke = self.broke or retryable_pull(e)
            raise
        finally:
            self.claim = tensors.claim or self.claim

    def retryable(self, error: HandoffError) -> bool:
        return retryable_pull(error) or (self.broke and isinstance(error, AlreadyClaimed))


class PulledTensors:
    """One pull's stream: iterate for `(carried, array)` as each tensor completes; then `.handoff`, confirmed."""

    def __init__(
        self,
        client: HandoffClient,
        declared: Contract,
        shard: Shard,
        handoff_id: str,
        stream: Iterator,
        timeout: float,
        arrays: list[np.ndarray] | None = None,
    ) -> None:
        self._client = client
        self._declared = declared
        self._shard = shard
        self._arrays = arrays
        self._handoff_id = handoff_id
        self._stream = stream
        self._timeout = timeout
        self._handoff: Handoff | None = None
        self.claim = 0
        """The claim's generation, once the header has come."""

    @property
    def handoff(self) -> Handoff:
        """The whole hand-off; available once iteration has ended normally (and the claim is confirmed)."""
        if self._handoff is None:
            raise RuntimeError("the pull has not been iterated to its end")
        return self._handoff

    def __iter__(self) -> Iterator[tuple[Carried, np.ndarray]]:
        try:
            header, handoff = yield from self._receive()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except BaseException:
            self._stream.cancel()  # the broker returns the claim at once, for the next pull
            raise
        model, shard = self._declared.model, shard_to_proto(self._shard)
        self._client._confirm_claim(model, self._handoff_id, header.claim, self._timeout, shard)
        self._handoff = handoff

    def _receive(self) -> Iterator[tuple[Carried, np.ndarray]]:
        model, stream = self._declared.model, self._stream
        header = next(stream, None)
        if not isinstance(header, pb.PullHeader):
            raise MalformedRequest("the broker's pull stream did not start with a header", model)
        self.claim = header.claim
        if header.fingerprint != self._declared.fingerprint:
            raise FingerprintMismatch(model, header.fingerprint, self._declared.fingerprint)
        contract = view(self._declared.at(header.position), self._shard, pushing=False)
        if self._arrays is None:
            arrays = [np.empty(c.shape, c.numpy_dtype) for c in contract.carried]
        else:  # the caller's cache arrays: the filled rows of each, a contiguous view
            arrays = [a[: c.rows] if c.cache_rows else a for c, a in zip(contract.carried, self._arrays)]
        flats = [a.reshape(-1).view(np.uint8) for a in arrays]
        spans = [TensorSpans(model, c) for c in contract.carried]
        for carried, array in zip(contract.carried, arrays):
            if carried.nbytes == 0:  # no rows filled yet (position 0): whole without a chunk
                yield carried, array
        entries: list[tuple[int, int, int, int]] = []
        for message in stream:
            if isinstance(message, ChunkFrame):
                index = contract.index(message.tensor)
                length = len(message.data)
                spans[index].add(message.offset, length)
                if crc32c(message.data) != message.crc32c:
                    raise BadChunk(model, message.tensor, message.offset, length, "fails its CRC32C on arrival")
                flats[index][message.offset : message.offset + length] = np.frombuffer(message.data, np.uint8)
                entries.append((index, message.offset, length, message.crc32c))
                if spans[index].complete:
                    yield contract.carried[index], arrays[index]
            elif isinstance(message, pb.PullEnd):
                for tensor_spans in spans:
                    tensor_spans.check_complete()
                got = handoff_digest(entries)
                if got != message.digest:
                    raise DigestMismatch(model, self._handoff_id, message.digest, got)
                state = {c.name: a for c, a in zip(contract.carried, arrays)}
                return header, Handoff(header.position, state)
            else:
                raise MalformedRequest("the broker's pull stream sent a second header", model)
        raise MalformedRequest("the broker's pull stream ended without its end message", model)
