"""`handoff-broker health` and `status`: of one broker, or of a fleet target (`a:1,b:2`, `dns:///name:port`,
`etcd://host/prefix`): the brokers of the set as a fleet client sees them (handoff_client.fleet.BrokerSet), each
asked on its own, at once, and reported by name; then one line for the fleet. Exit 0 only when every broker answered
(status) or is SERVING (health); a set that cannot be read, or that is empty, exits 1 saying so. Client-only: health
of one broker imports grpc and nothing heavier (a container's HEALTHCHECK runs it every few seconds)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from handoff_client.protocol.errors import HandoffError
from handoff_client.protocol.targets import is_fleet

from .commands import HEALTH_CHECK, SERVING_STATUS, _connection, _short_prompt_bytes, human_size

if TYPE_CHECKING:
    from handoff_client import BrokerStatus

T = TypeVar("T")


def health(args: argparse.Namespace) -> int:
    """Exit 0 when the broker at --target reports SERVING over the gRPC health service (Docker's HEALTHCHECK), for
    --service ("": the broker itself; handoff.v1.Fleet: in its fleet's set). The call is made by hand (a
    HealthCheckRequest whose field 1 is the service's name; the response's field 1, a varint, is the status), so the
    client-only install can run it. A fleet target (`a:1,b:2`, `dns:///...`, `etcd://...`): each broker's, by name,
    and exit 0 only when every one is SERVING (below). --health-port asks the broker's health port (serve
    --health-port) on the target's host, in plaintext, as Kubernetes' gRPC probes do."""
    if is_fleet(args.target):
        return fleet_health(args)
    ok, line = health_of(args.target, args)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def health_of(target: str, args: argparse.Namespace) -> tuple[bool, str]:
    """Whether the broker at `target` is SERVING (for --service), and the line that says so."""
    import grpc
    from handoff_client import make_channel  # (grpc only: a HEALTHCHECK every 10 s stays cheap)

    tls = _connection(args)
    token = tls.pop("token")  # health needs none; a token sent is not counted among the probes (probe_calls.py)
    if getattr(args, "health_port", None) not in (None, -1):  # the health port: plaintext, on the broker's host
        target, tls, token = f"{target.rsplit(':', 1)[0]}:{args.health_port}", {}, None
    with make_channel(target, **tls) as channel:
        check = channel.unary_unary(HEALTH_CHECK, request_serializer=bytes, response_deserializer=bytes)
        try:
            service = args.service.encode()  # (at most 127 bytes, the CLI checked: one length byte)
            request = b"\x0a" + bytes([len(service)]) + service if service else b""
            metadata = (("authorization", f"Bearer {token}"),) if token else None
            response = check(request, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as e:
            return False, f"{target}: {e.code().name}"
    status = response[1] if response[:1] == b"\x08" and len(response) == 2 else 0  # (every status is one byte)
    return status == 1, f"{target}: {SERVING_STATUS.get(status, 'UNKNOWN')}"


def status(args: argparse.Namespace) -> int:
    """What a live broker holds, read over its GetStatus RPC. A fleet target: each broker's by name, then the
    fleet's total (below); exit 0 only when every broker answered."""
    if is_fleet(args.target):
        return fleet_status(args)
    answer, lines = status_of(args.target, args)
    print("\n".join(lines), file=sys.stdout if answer is not None else sys.stderr)
    return 0 if answer is not None else 1


def status_of(target: str, args: argparse.Namespace) -> tuple[BrokerStatus | None, list[str]]:
    """The broker's status (None: it did not answer) and the lines that tell it."""
    from handoff_client import HandoffClient, HandoffError

    with HandoffClient(target, **_connection(args)) as client:
        try:
            status = client.status(timeout=args.timeout)
        except HandoffError as e:
            return None, [f"{target}: {e.message}"]
    held = status.receiving + status.ready + status.claimed
    share = status.resident_bytes / status.max_bytes if status.max_bytes else 0.0
    lines = [
        f"{target}: {'DRAINING' if status.draining else 'serving'}",
        (
            f"  hand-offs held: {held} ({status.receiving} receiving, {status.ready} ready, "
            f"{status.claimed} claimed); oldest {status.oldest_seconds:.1f} s"
        ),
        (
            f"  bytes: {status.resident_bytes} of {status.max_bytes} ({human_size(status.resident_bytes)} of "
            f"{human_size(status.max_bytes)}, {100 * share:.1f}%); {status.tombstones} recently gone remembered"
        ),
    ]
    for contract in status.contracts:
        lines.append(
            f"  contract {contract.model}: ctx {contract.ctx}, {len(contract.carried)} tensors, "
            f"{contract.nbytes} bytes a hand-off at the full ctx, {_short_prompt_bytes(contract)}, "
            f"fingerprint {contract.fingerprint[:16]}"
        )
    return status, lines


def _each_broker(args: argparse.Namespace, ask: Callable[[str, argparse.Namespace], T]) -> list[tuple[str, T]] | None:
    """`ask(broker, args)` for every broker of the set, concurrently, in the set's order; None (said on stderr)
    when the set cannot be read or is empty."""
    from handoff_client.fleet import BrokerSet

    try:
        brokers = BrokerSet(args.target).brokers()
    except (HandoffError, OSError) as e:
        print(f"{args.target}: the fleet's broker set cannot be read: {getattr(e, 'message', e)}", file=sys.stderr)
        return None
    if not brokers:
        print(f"{args.target}: no broker in the fleet's set", file=sys.stderr)
        return None
    with ThreadPoolExecutor(min(len(brokers), 16)) as pool:
        return list(zip(brokers, pool.map(lambda broker: ask(broker, args), brokers), strict=True))


def fleet_health(args: argparse.Namespace) -> int:
    """Each broker's health line, then `fleet TARGET: k of n SERVING`."""
    answers = _each_broker(args, health_of)
    if answers is None:
        return 1
    for _, (_, line) in answers:
        print(line)
    serving = sum(ok for _, (ok, _) in answers)
    print(f"fleet {args.target}: {serving} of {len(answers)} brokers SERVING")
    return 0 if serving == len(answers) else 1


def fleet_status(args: argparse.Namespace) -> int:
    """Each broker's status block, then the fleet's total: brokers answering, hand-offs held, bytes."""
    answers = _each_broker(args, status_of)
    if answers is None:
        return 1
    for _, (_, lines) in answers:
        print("\n".join(lines))
    statuses = [status for _, (status, _) in answers if status is not None]
    held = sum(s.receiving + s.ready + s.claimed for s in statuses)
    resident, most = sum(s.resident_bytes for s in statuses), sum(s.max_bytes for s in statuses)
    draining = sum(s.draining for s in statuses)
    silent = [broker for broker, (status, _) in answers if status is None]
    print(
        f"fleet {args.target}: {len(statuses)} of {len(answers)} brokers answered"
        + (f" ({', '.join(silent)} did not)" if silent else "")
        + (f", {draining} draining" if draining else "")
        + f"; hand-offs held: {held}; bytes: {resident} of {most} ({human_size(resident)} of {human_size(most)})"
    )
    return 0 if not silent else 1
