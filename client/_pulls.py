"""The decode side's receiving: a pull's attempts (each retry names the claim its broken predecessor held), and one
pull's stream — its chunks on the stream or on its lane (docs/lanes.md), each checked, written into place, and the
whole checked against the digest before the claim is confirmed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from difflib import get_close_matches
from typing import TYPE_CHECKING

import grpc
import numpy as np

from ._calls import retryable_pull
from ._lane_choice import describe, fell_back, open_frames
from .protocol.contract import Carried, Contract, Handoff
from .protocol.errors import (
    AlreadyClaimed,
    BadChunk,
    DigestMismatch,
    FingerprintMismatch,
    HandoffError,
    LaneBroken,
    MalformedRequest,
    MissingTensor,
    WrongLayout,
    WrongLength,
    from_rpc_error,
)
from .protocol.frames import ChunkFrame, crc32c, handoff_digest
from .protocol.lane import OPENING_TIMEOUT, LaneUnreachable
from .protocol.messages import handoff_pb2 as pb
from .protocol.shards import Shard, view
from .protocol.spans import TensorSpans
from .protocol.wire import shard_to_proto

if TYPE_CHECKING:
    from ._client import BrokerClient


def destinations(contract: Contract, into: Mapping[str, np.ndarray] | None) -> list[np.ndarray] | None:
    """The caller's arrays for a pull, in contract order, each checked to take its tensor's bytes in place. A mistake
    is the caller's `into=`, and its message says so, in shapes: MissingTensor for a carried tensor it has no array
    for (naming a key it has that the contract does not carry and that resembles it), WrongLength for an array of
    another size, WrongLayout for another shape, dtype, or one that is not C-contiguous and writable."""
    if into is None:
        return None
    arrays = []
    for carried in contract.carried:
        array = into.get(carried.name)
        fields = {"model": contract.model, "tensor": carried.name, "want": carried.layout()}
        start = f"{contract.model}: `pull(into=...)`"
        if array is None:
            strangers = [name for name in into if name not in {c.name for c in contract.carried}]
            like = "".join(f" (it has `{name}`: misspelled?)" for name in get_close_matches(carried.name, strangers, 1))
            raise MissingTensor._rebuild(f"{start} has no array for `{carried.name}` ({carried.layout()}){like}: "
                                         "give one for every carried tensor", fields)  # fmt: skip
        if not isinstance(array, np.ndarray):
            got = f"a {type(array).__name__}, not a numpy array"
        elif array.shape != carried.shape or array.dtype != carried.numpy_dtype:
            got = f"{array.shape} {array.dtype}"
        elif not (array.flags.c_contiguous and array.flags.writeable):
            got = f"{array.shape} {array.dtype} but not C-contiguous and writable, so it cannot be filled in place"
        else:
            arrays.append(array)
            continue
        kind = WrongLength if isinstance(array, np.ndarray) and array.size != carried.values else WrongLayout
        message = (f"{start}'s `{carried.name}` is {got}; a buffer for it is {carried.layout()}, C-contiguous "
                   "and writable (nothing is cast or reshaped)")  # fmt: skip
        raise kind._rebuild(message, {**fields, "got": got})
    return arrays


class PullAttempts:
    """Successive attempts at one pull. A retry names the claim its broken predecessor held, so the broker hands it
    over at once; and after a break, ALREADY_CLAIMED may be that very claim, not yet noticed dead: retry it too."""

    def __init__(
        self,
        client: BrokerClient,
        model: str,
        handoff_id: str,
        shard: Shard,
        into: Mapping[str, np.ndarray] | None,
        wait_for_push: float | None,
        ticket: str | None = None,
    ) -> None:
        self.client = client
        self.ticket = ticket  # (each attempt sends its broker incarnation)
        self.model = model
        self.handoff_id = handoff_id
        self.shard = shard
        self.into = into
        self.wait_for_push = wait_for_push
        self.claim = 0
        self.broke = False
        self.lanes = True  # until a lane breaks: the retries then go on the stream

    def run(self, timeout: float) -> Handoff:
        tensors = self.client.pull_tensors(self.model, self.handoff_id, timeout=timeout, supersedes=self.claim,
                                           shard=self.shard, into=self.into, wait_for_push=self.wait_for_push,
                                           lanes=self.lanes, ticket=self.ticket)  # fmt: skip
        try:
            for _ in tensors:
                pass
            return tensors.handoff
        except HandoffError as e:
            self.broke = self.broke or retryable_pull(e)
            if self.lanes and isinstance(e, LaneBroken):
                self.lanes = False
                fell_back("pull", e)
            raise
        finally:
            self.claim = tensors.claim or self.claim
            self.lanes = self.lanes and not tensors.left_its_lane  # (its retries go on the stream too)

    def retryable(self, error: HandoffError) -> bool:
        return retryable_pull(error) or (self.broke and isinstance(error, AlreadyClaimed))


class PulledTensors:
    """One pull's stream: iterate for `(carried, array)` as each tensor completes; then `.handoff`, confirmed.

    A pull whose lane breaks (cannot be reached, cannot open within the opening deadline, or breaks midway) starts
    over on the gRPC stream within the same iteration and the same timeout, naming the claim it held so the broker
    hands it over at once: each tensor is then yielded again, and the last yield of a tensor is the one that counts
    (a decoder writing each into its pages by name just writes it again)."""

    def __init__(
        self,
        client: BrokerClient,
        declared: Contract,
        shard: Shard,
        handoff_id: str,
        stream: Iterator,
        timeout: float,
        arrays: list[np.ndarray] | None = None,
        request: pb.PullRequest | None = None,
        pushing: bool = False,
    ) -> None:
        self._client = client
        self._pushing = pushing  # an audit read of a part as its rank pushed it (_audit_read.py)
        self._declared = declared
        self._shard = shard
        self._arrays = arrays
        self._handoff_id = handoff_id
        self._stream = stream
        self._timeout = timeout
        self._request = request or pb.PullRequest()
        self._handoff: Handoff | None = None
        self.claim = 0
        """The claim's generation, once the header has come."""
        self.position: int | None = None
        """The hand-off's position, once the header has come (before the first tensor is yielded)."""
        self.left_its_lane = False
        """Whether its lane broke and it went on the stream."""

    @property
    def handoff(self) -> Handoff:
        """The whole hand-off; available once iteration has ended normally (and the claim is confirmed)."""
        if self._handoff is None:
            raise RuntimeError("the pull has not been iterated to its end")
        return self._handoff

    def __iter__(self) -> Iterator[tuple[Carried, np.ndarray]]:
        started = time.monotonic()
        try:
            try:
                header, handoff = yield from self._translated()
            except LaneBroken as e:
                if not self._request.lane_capability:
                    raise
                fell_back("pull", e)
                self.left_its_lane = True
                self._on_the_stream(max(self._timeout - (time.monotonic() - started), 0.0))
                header, handoff = yield from self._translated()
        except BaseException:
            self._stream.cancel()  # the broker returns the claim at once, for the next pull
            raise
        model, shard = self._declared.model, shard_to_proto(self._shard)
        if not self._request.audit:  # (an audit read claims nothing: there is nothing to confirm)
            self._client._confirm_claim(model, self._handoff_id, header.claim, self._timeout, shard)
        self._handoff = handoff

    def _translated(self) -> Iterator[tuple[Carried, np.ndarray]]:
        try:
            return (yield from self._receive())
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _on_the_stream(self, timeout: float) -> None:
        """After the lane broke: this call is cancelled (the broker returns its claim at once), and the pull made
        again with no lane, naming that claim, for what is left of `timeout`."""
        self._stream.cancel()
        request = pb.PullRequest()
        request.CopyFrom(self._request)
        request.supersedes = self.claim or request.supersedes
        for lane_field in ("lane_capability", "lane_kind", "lane_connections"):
            request.ClearField(lane_field)
        self._request, self._timeout = request, timeout
        self._stream = self._client._pull(request, timeout=timeout, metadata=self._client._metadata)

    def _receive(self) -> Iterator[tuple[Carried, np.ndarray]]:
        model, stream = self._declared.model, self._stream
        header = next(stream, None)
        if not isinstance(header, pb.PullHeader):
            raise MalformedRequest("the broker's pull stream did not start with a header", model)
        self.claim, self.position = header.claim, header.position
        if self._request.audit and header.claim:  # a broker that knows no audit reads claimed it: give it back now
            raise MalformedRequest("the broker answered an audit read with a claim (a release without audit reads, "
                                   "PullRequest.audit); the read is cancelled, which gives the claim back", model)  # fmt: skip
        if header.fingerprint != self._declared.fingerprint:
            raise FingerprintMismatch(model, header.fingerprint, self._declared.fingerprint)
        contract = view(self._declared.at(header.position), self._shard, pushing=self._pushing)
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
        on_lane = header.HasField("lane")
        if on_lane:  # the chunks come on the lane; the end, here
            yield from self._on_lane(header.lane, contract, spans, flats, arrays, entries)
        for message in stream:
            if isinstance(message, ChunkFrame):
                if on_lane:
                    raise MalformedRequest("the broker sent a chunk on the stream of a pull on a lane", model)
                index = contract.index(message.tensor)
                length = len(message.data)
                spans[index].add(message.offset, length)
                whole = _checked(spans[index], entries, index, message.offset, message.data, message.crc32c)
                flats[index][message.offset : message.offset + length] = np.frombuffer(message.data, np.uint8)
                if whole:
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

    def _on_lane(
        self,
        lane: pb.Lane,
        contract: Contract,
        spans: list[TensorSpans],
        flats: list[np.ndarray],
        arrays: list[np.ndarray],
        entries: list[tuple[int, int, int, int]],
    ) -> Iterator[tuple[Carried, np.ndarray]]:
        """Receive the chunks on the pull's lane, each straight into its place in the arrays after its bounds are
        checked, then its CRC32C; as on the stream, yield each tensor once whole."""
        model = contract.model
        capability = self._request.lane_capability
        if not capability or lane.kind not in (self._request.lane_kind or pb.LANE_KIND_TCP, pb.LANE_KIND_TCP):
            raise MalformedRequest("the broker named a lane for a pull that offered none, or another kind", model)
        try:
            connections = self._request.lane_connections or 1
            ready_by = time.monotonic() + OPENING_TIMEOUT  # the broker sends READY once the connections are in

            def given_up() -> bool:
                return time.monotonic() > ready_by

            frames = open_frames(lane, self._client.target, capability, self._timeout, "pull", given_up, connections)
            try:
                while not (frame := frames.read_header()).end:
                    if frame.index >= len(contract.carried):
                        raise MalformedRequest(f"lane frame for tensor index {frame.index} of {len(contract.carried)}")
                    spans[frame.index].add(frame.offset, frame.length)  # bounds and overlap, before the bytes land
                    into = memoryview(flats[frame.index])[frame.offset : frame.offset + frame.length]
                    frames.read_into(frame, into)
                    if _checked(spans[frame.index], entries, frame.index, frame.offset, into, frame.crc):
                        yield contract.carried[frame.index], arrays[frame.index]
            finally:
                frames.close()
        except (OSError, ValueError) as e:  # (LaneClosed, LaneUnreachable and socket timeouts are OSErrors)
            broken = LaneBroken(model, f"the pull on {describe(lane, self._client.target)}: {e}")
            if isinstance(e, LaneUnreachable):  # never reached: the broker, waiting for it, has nothing to say yet
                self._client.lane_offers.unreachable(lane)
                raise broken from None  # (and the call is cancelled, so the claim goes back at once)
            self._stream_status()  # the broker may have ended the call (the push failed, a cancel): that says why
            raise broken from None

    def _stream_status(self) -> None:
        """After the lane ended early: raise the call's own error, if the broker ended it with one. The broker ends a
        call whose lane broke as soon as it sees it, and gives up a lane that did not open within OPENING_TIMEOUT: a
        call still open after that long is left (and cancelled by the caller)."""
        ended = threading.Event()
        self._stream.add_done_callback(lambda _: ended.set())
        if not ended.wait(OPENING_TIMEOUT):
            return
        try:
            next(self._stream, None)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


def _checked(
    spans: TensorSpans, entries: list[tuple[int, int, int, int]], index: int, offset: int, data: object, crc: int
) -> bool:
    """A received chunk (its bounds and overlap already checked by `spans.add`), on the stream or the lane alike: its
    CRC32C checked and its digest entry noted; whether its tensor is now whole."""
    length = len(data)  # type: ignore[arg-type]
    if crc32c(data) != crc:
        raise BadChunk(spans.model, spans.carried.name, offset, length, "fails its CRC32C on arrival")
    entries.append((index, offset, length, crc))
    return spans.complete
