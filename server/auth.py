"""Who may call what: bearer tokens with roles, optionally scoped to models, checked by a server interceptor.

    prefill   PushHandoff, GetPushProgress, CancelHandoff
    decode    PullHandoff, ConfirmHandoff
    admin     GetStatus
    prefill, decode   GetLanes (the workers that push and pull: it shows the shared-memory lane's socket path and
              the host's boot id, which no other role needs)
    any role  ListContracts, GetContract (both workers need the contract)

Health and reflection stay open, for probes and grpcurl. Tokens are never stored or logged: the token file holds
their sha256, and an incoming token's hash is compared with every entry in constant time. The file (or the
environment variable HANDOFF_TOKENS naming it) looks like

    {"tokens": [{"name": "prefill-pool", "sha256": "<hex of sha256(token)>", "roles": ["prefill"],
                 "models": ["demo-hybrid"]}]}

`models` is optional (all models when absent). `handoff-broker hash-token` prints a token's sha256 from stdin.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_status import rpc_status
from handoff_client.protocol.contract import ManifestError
from handoff_client.protocol.errors import HandoffError, PermissionDenied, Unauthenticated, to_status
from handoff_client.protocol.wire import SERVICE, SERVICE_NAME

ROLES = frozenset({"prefill", "decode", "admin"})
METHOD_ROLES: dict[str, frozenset[str]] = {
    "PushHandoff": frozenset({"prefill"}),
    "GetPushProgress": frozenset({"prefill"}),
    "CancelHandoff": frozenset({"prefill"}),
    "PullHandoff": frozenset({"decode"}),
    "ConfirmHandoff": frozenset({"decode"}),
    "GetStatus": frozenset({"admin"}),
    "ListContracts": ROLES,
    "GetContract": ROLES,
    "GetLanes": frozenset({"prefill", "decode"}),
}


@dataclass(frozen=True)
class Principal:
    """A token's holder: its name (for messages and logs), roles and, if scoped, models."""

    name: str
    roles: frozenset[str]
    models: frozenset[str] | None


_caller: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("handoff_caller", default=None)


def authorize_model(model: str) -> None:
    """Inside a call: refuse it if the caller's token is scoped to other models."""
    caller = _caller.get()
    if caller is not None and caller.models is not None and model not in caller.models:
        raise PermissionDenied(caller.name, f"is not scoped to model `{model}`", model)


def authorize_lanes(model: str) -> None:
    """Inside GetLanes: a caller whose token is scoped to models names one of them (`model`), as every call on one
    model does; an unscoped caller may name none."""
    caller = _caller.get()
    if caller is not None and caller.models is not None and not model:
        raise PermissionDenied(caller.name, "is scoped to models: GetLanes must name one (LanesRequest.model)")
    if model:
        authorize_model(model)


def may_see(model: str) -> bool:
    """Inside a call: whether the caller's token covers `model` (for listing contracts)."""
    caller = _caller.get()
    return caller is None or caller.models is None or model in caller.models


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenTable:
    """The tokens a broker accepts, by hash."""

    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        self._entries = entries

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ManifestError(f"{path}: not a readable token file: {e}") from None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not tokens:
            raise ManifestError(f"{path}: tokens: must be a non-empty list")
        entries = []
        for i, entry in enumerate(tokens):
            where = f"{path}: tokens[{i}]"
            if not isinstance(entry, dict):
                raise ManifestError(f"{where}: must be an object")
            digest, roles, models = entry.get("sha256"), entry.get("roles"), entry.get("models")
            if not isinstance(digest, str) or len(digest) != 64:
                raise ManifestError(f"{where}.sha256: must be the 64 hex digits of the token's sha256")
            if not isinstance(roles, list) or not roles or not set(roles) <= ROLES:
                raise ManifestError(f"{where}.roles: must be a non-empty list of {', '.join(sorted(ROLES))}")
            if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
                raise ManifestError(f"{where}.models: must be a list of model names")
            try:
                raw = bytes.fromhex(digest)
            except ValueError:
                raise ManifestError(f"{where}.sha256: not hex") from None
            name = str(entry.get("name") or f"token {i}")
            entries.append((raw, Principal(name, frozenset(roles), None if models is None else frozenset(models))))
        return cls(entries)

    def authenticate(self, token: str) -> Principal | None:
        """The token's principal, or None. Every entry is compared, in constant time, whatever matches."""
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for raw, principal in self._entries:
            if hmac.compare_digest(digest, raw):
                found = principal
        return found


class AuthInterceptor(grpc.ServerInterceptor):
    """Authenticates every call of the HandoffBroker service and checks its role; leaves the rest open."""

    def __init__(self, tokens: TokenTable, on_refusal: Callable[[HandoffError], None]) -> None:
        self._tokens = tokens
        self._on_refusal = on_refusal

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        prefix = f"/{SERVICE_NAME}/"
        if not details.method.startswith(prefix):
            return continuation(details)
        name = details.method[len(prefix) :]
        token = bearer(details.invocation_metadata)
        principal = self._tokens.authenticate(token) if token else None
        if principal is None:
            return self._refuse(name, Unauthenticated("no bearer token" if not token else "an unknown bearer token"))
        allowed = METHOD_ROLES.get(name, frozenset())
        if not principal.roles & allowed:
            roles = ", ".join(sorted(principal.roles))
            needs = " or ".join(sorted(allowed)) or "a role no token has"
            return self._refuse(name, PermissionDenied(principal.name, f"has roles {roles}; {name} needs {needs}"))
        handler = continuation(details)
        return None if handler is None else _as(principal, handler)

    def _refuse(self, name: str, error: HandoffError) -> grpc.RpcMethodHandler:
        """A handler that ends the call with `error` without reading its request: registered as request-streaming
        whatever the method, since grpcio reads a unary request whole (up to the receive limit) before its handler
        runs, and waits for it with no deadline. So an unauthenticated caller costs what its HTTP/2 window let in
        and a moment of a thread: 8 GetStatus calls of 63 MiB with no token grew the broker 389 MiB before this,
        and 300 whose message never came held 300 worker threads."""
        self._on_refusal(error)
        status = rpc_status.to_status(to_status(error))

        def abort(requests: object, context: grpc.ServicerContext) -> None:
            context.abort_with_status(status)

        method = SERVICE.methods_by_name.get(name)
        if method is not None and method.server_streaming:
            return grpc.stream_stream_rpc_method_handler(abort)
        return grpc.stream_unary_rpc_method_handler(abort)


def bearer(metadata: tuple | None) -> str:
    """The call's bearer token (its `authorization: Bearer ...` metadata), or ""."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return ""


def _as(principal: Principal, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler, run with `principal` as the caller (for model scoping inside the servicer)."""

    def unary(behaviour: Callable) -> Callable:
        def run(request: object, context: grpc.ServicerContext) -> object:
            token = _caller.set(principal)
            try:
                return behaviour(request, context)
            finally:
                _caller.reset(token)

        return run

    def streaming(behaviour: Callable) -> Callable:
        def run(request: object, context: grpc.ServicerContext) -> Iterator[object]:
            responses = behaviour(request, context)
            while True:  # the caller is set around each step, so it never leaks past one
                token = _caller.set(principal)
                try:
                    response = next(responses)
                except StopIteration:
                    return
                finally:
                    _caller.reset(token)
                yield response

        return run

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=unary(handler.unary_unary))
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=unary(handler.stream_unary))
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=streaming(handler.unary_stream))
    return handler._replace(stream_stream=streaming(handler.stream_stream))
