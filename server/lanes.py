"""The broker's lanes: where a push's or a pull's bytes may travel instead of its gRPC stream — a TCP listener, and
a Unix socket for the shared-memory lane (clients on the broker's host, of the broker's user).

The gRPC call stays the control plane: its handler registers the capability the client sent on the call
(`expect`), and the connection that presents it first, within the call's wait, is handed to that handler alone.
A connection is read for nothing but its opening (MAGIC and a capability, 40 bytes) and held no longer than
OPENING_TIMEOUT for its call to register that capability (a pusher opens its lane as it sends the header, which the
call may not have read yet), MAX_OPENINGS at a time; one that presents anything else is closed unanswered. When
all MAX_OPENINGS are taken a new connection takes the place of the oldest of the source (peer address, or process on
the Unix socket) holding the most, so idle connections hold nothing past OPENING_TIMEOUT and no source more than its
share. A capability is single-use, void once its call ends, and bound to that call's hand-off and direction by being
known only to its handler.
A connection on the Unix socket is accepted only from a peer of the broker's own user (SO_PEERCRED), and the
socket sits in a directory only that user can enter.
The wire is handoff_client/protocol/lane.py and ring.py (and docs/lanes.md).
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from handoff_client.protocol.lane import CAPABILITY_BYTES, MAGIC, OPENING_TIMEOUT, tune
from handoff_client.protocol.seal import sealed_opening

from . import sockets

logger = logging.getLogger(__name__)

# OPENING_TIMEOUT (protocol.lane): seconds a new connection has to present its opening and be taken by its call
MAX_OPENINGS = 64  # connections being read for their opening at once; past it a new one takes the place of another
# Seconds the listeners rest when accept fails for want of descriptors: the first rest, and the most (it doubles).
ACCEPT_REST = (0.02, 1.0)
VOIDED_REMEMBERED = 4096  # capabilities whose call ended, remembered so a late opening is closed at once
OPENING_BYTES = len(MAGIC) + CAPABILITY_BYTES


@dataclass(eq=False)
class Expected:
    """A call waiting for its lane: the connection that presented its capability, once one has."""

    capability: bytes
    sealed_opening: bytes = b""  # what opens it on a sealed TCP lane (handoff_client/protocol/seal.py)
    arrived: threading.Event = field(default_factory=threading.Event)
    sock: socket.socket | None = None
    closed: bool = False

    def wait(self, timeout: float) -> socket.socket | None:
        """The lane's connection, once it has presented the capability; None if none came within `timeout` s, or
        at once when the call is done with its lane (`LaneListener.forget`: the call ended), the wait then holding
        nothing. The caller sends READY when its call is ready for the bytes (a push: once admitted, room reserved)."""
        if not self.arrived.wait(timeout):
            return None
        return self.sock


@dataclass(eq=False)
class _Opening:
    """A connection whose opening is being read (or is read, its capability not registered yet), from `source`: its
    peer's address on TCP, its peer's process on the Unix socket."""

    sock: socket.socket
    deadline: float
    source: str
    received: bytearray = field(default_factory=bytearray)

    @property
    def capability(self) -> bytes | None:
        """The capability presented, once the whole opening is in and starts with MAGIC."""
        if len(self.received) < OPENING_BYTES or not self.received.startswith(MAGIC):
            return None
        return bytes(self.received[len(MAGIC) :])


class LaneListener:
    """The lanes' listeners, and the capabilities the calls under way expect. One thread reads every opening
    (non-blocking, through a selector): a connection costs no thread of its own, only its socket and 40 bytes.

    `tcp` listens for the TCP lane on (host, port), its frames `sealed` or not, one call's lane striped over at most
    `max_connections`; `socket_path` for the shared-memory lane ("": a socket in a new directory of the broker's
    own, removed at close; None: no shared-memory lane)."""

    def __init__(
        self,
        tcp: tuple[str, int] | None,
        advertise_host: str = "",
        socket_path: str | None = None,
        sealed: bool = False,
        max_connections: int = 1,
    ) -> None:
        self._listeners: list[socket.socket] = []
        self._own_directory: str | None = None
        self.port: int | None = None  # the TCP lane's, if offered
        self.socket_path: str | None = None  # the shared-memory lane's, if offered
        try:
            if tcp is not None:
                host, port = tcp
                try:
                    listener = socket.create_server((host, port), family=sockets.family(host), backlog=128)
                except OSError as e:
                    raise OSError(
                        f"cannot listen for the TCP lane (--lane-port) on {host}:{port}: {e.strerror or e}"
                    ) from None
                self._listeners.append(listener)
                self.port = listener.getsockname()[1]
            if socket_path is not None:
                try:
                    self._listeners.append(self._unix_listener(socket_path))
                except OSError as e:
                    where = socket_path or "a new private directory"
                    raise OSError(
                        f"cannot listen for the shared-memory lane (--lane-socket) at {where}: {e.strerror or e}"
                    ) from None
        except BaseException:
            self._unlisten()
            raise
        for listener in self._listeners:
            listener.setblocking(False)
        self.advertise_host = advertise_host  # empty: the client uses the host it reached the broker at
        self.sealed = sealed  # the TCP lane's frames sealed (a broker serving TLS): handoff_client/protocol/seal.py
        self.max_connections = max_connections
        self._expected: dict[bytes, Expected] = {}
        self._sealed_openings: dict[bytes, bytes] = {}  # what opens a sealed TCP lane: the capability it stands for
        self._voided: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._wake_reader, self._wake_writer = socket.socketpair()  # a registration wakes the reading thread
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)  # a call never waits on the reading thread: a full buffer is awake already
        self._openings: dict[socket.socket, _Opening] = {}  # touched by the reading thread only
        self._resting_until: float | None = None  # ... as are these: the listeners rest, out of descriptors
        self._rest = ACCEPT_REST[0]
        self._closed = False
        self._thread = threading.Thread(target=self._serve_forever, name="handoff-lane-openings", daemon=True)

    def _unix_listener(self, path: str) -> socket.socket:
        """The shared-memory lane's socket: at `path` (one left by a broker that is gone is replaced), or in a new
        directory only this user can enter; either way a socket only this user may connect to."""
        if not path:
            self._own_directory = tempfile.mkdtemp(prefix="handoff-broker-")  # (mode 0700)
            path = os.path.join(self._own_directory, "lane.sock")
        elif sockets.stale_socket(path):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
        self.socket_path = path
        return listener

    def _unlisten(self) -> None:
        for listener in self._listeners:
            listener.close()
        if self.socket_path is not None and sockets.stale_socket(self.socket_path):
            os.unlink(self.socket_path)
        if self._own_directory is not None:
            shutil.rmtree(self._own_directory, ignore_errors=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        self._wake()
        if self._thread.ident is not None:  # (a broker whose start failed closes a listener never started)
            self._thread.join(timeout=5)
        self._unlisten()
        self._wake_reader.close()
        self._wake_writer.close()
        with self._lock:
            expected = list(self._expected.values())
        for waiting in expected:
            self.forget(waiting)

    def expect(self, capability: bytes) -> Expected:
        """Register a call's capability (ValueError if it is not CAPABILITY_BYTES long, or already registered)."""
        if len(capability) != CAPABILITY_BYTES:
            raise ValueError(f"a lane capability is {CAPABILITY_BYTES} bytes, not {len(capability)}")
        waiting = Expected(capability, sealed_opening(capability) if self.sealed else b"")
        with self._lock:
            if capability in self._expected or capability in self._voided:
                raise ValueError("that lane capability is already in use")
            self._expected[capability] = waiting
            if self.sealed and self.port is not None:
                self._sealed_openings[waiting.sealed_opening] = capability
        self._wake()  # an opening that presented it before the call registered it is waiting
        return waiting

    def forget(self, waiting: Expected) -> None:
        """The call is done with its lane (or never got one): the capability is void, its connection closed."""
        with self._lock:
            if self._expected.get(waiting.capability) is waiting:
                del self._expected[waiting.capability]
            self._void(waiting.capability)
            self._forget_sealed_opening(waiting)
            waiting.closed = True
            sock, waiting.sock = waiting.sock, None
        waiting.arrived.set()  # a handler waiting for the lane is let go now, with nothing (its call has ended)
        self._wake()  # an opening that presented it is closed at once
        if sock is not None:
            sockets.close(sock)

    def _void(self, capability: bytes) -> None:
        """Under the lock: remember the capability as used, so an opening presenting it again is closed at once."""
        self._voided[capability] = None
        while len(self._voided) > VOIDED_REMEMBERED:
            self._voided.popitem(last=False)

    def _forget_sealed_opening(self, waiting: Expected) -> None:
        """Under the lock: the sealed opening of a capability just voided opens nothing again, and is closed at once."""
        if waiting.sealed_opening:
            self._sealed_openings.pop(waiting.sealed_opening, None)
            self._void(waiting.sealed_opening)

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"\0")
        except OSError:  # the buffer is full (it is awake already), or the listener is closed
            pass

    def _serve_forever(self) -> None:
        with selectors.DefaultSelector() as selector:
            self._watch(selector)
            while not self._closed:
                deadlines = [opening.deadline for opening in self._openings.values()]
                if self._resting_until is not None:
                    deadlines.append(self._resting_until)
                timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                if self._resting_until is not None and time.monotonic() >= self._resting_until:
                    self._resting_until = None  # try the listeners again
                    for listener in self._listeners:
                        selector.register(listener, selectors.EVENT_READ, "listener")
                self._pass(selector, selector.select(timeout))
            for opening in list(self._openings.values()):
                sockets.close(opening.sock)

    def _watch(self, selector: selectors.BaseSelector) -> None:
        for listener in self._listeners:
            selector.register(listener, selectors.EVENT_READ, "listener")
        selector.register(self._wake_reader, selectors.EVENT_READ)

    def _pass(self, selector: selectors.BaseSelector, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        """One pass over what a select found ready, in its order: accept, wake, or read an opening; then settle."""
        for key, _ in events:
            if key.data == "listener":
                self._accept(selector, key.fileobj)  # type: ignore[arg-type]
            elif key.fileobj is self._wake_reader:
                sockets.drain(self._wake_reader)
            elif (opening := self._openings.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                self._read(selector, opening)  # (None: an earlier accept in this pass made room with it)
        self._settle(selector)

    def _accept(self, selector: selectors.BaseSelector, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                self._rest = ACCEPT_REST[0]
                return
            except OSError as e:  # out of descriptors (EMFILE, ENFILE) or memory: rest, or this loop would spin
                self._rest_listeners(selector, e)
                return
            if sock.family == socket.AF_UNIX:
                pid, uid = sockets.peer(sock)
                if uid != os.geteuid():
                    logger.warning("a shared-memory lane connection from user %s, not the broker's: closed", uid)
                    sockets.close(sock)
                    continue
                source = f"process {pid}"
            else:
                source = sockets.address(sock)
            if len(self._openings) >= MAX_OPENINGS:
                self._make_room(selector)
            sock.setblocking(False)
            self._openings[sock] = _Opening(sock, time.monotonic() + OPENING_TIMEOUT, source)
            selector.register(sock, selectors.EVENT_READ)

    def _rest_listeners(self, selector: selectors.BaseSelector, error: OSError) -> None:
        """Stop watching the listeners for a while, as gRPC's own listener does: a connection waiting in the backlog
        keeps them readable, and accept fails until a descriptor is free, so watching them would spin a core. The
        rest doubles while accept keeps failing, up to ACCEPT_REST[1]; the connections wait in the backlog."""
        for listener in self._listeners:
            if listener in selector.get_map():
                selector.unregister(listener)
        self._resting_until = time.monotonic() + self._rest
        logger.warning("the lanes cannot accept a connection (%s): not trying again for %.2f s", error, self._rest)
        self._rest = min(2 * self._rest, ACCEPT_REST[1])

    def _make_room(self, selector: selectors.BaseSelector) -> None:
        """Every opening is taken: close one for a new connection, of the source holding the most (so no source holds
        more than its share while others wait), the oldest of those still presenting, else the oldest. A call's own
        connection presents its 40 bytes as it connects, so idle connections, however many, never keep it out."""
        held: dict[str, list[_Opening]] = {}
        for opening in self._openings.values():  # (in the order they came)
            held.setdefault(opening.source, []).append(opening)
        most = max(held.values(), key=len)
        presenting = [opening for opening in most if len(opening.received) < OPENING_BYTES]
        why = f"gave its place to a newer one ({len(most)} of the openings from {most[0].source})"
        self._drop(selector, (presenting or most)[0], why, logging.DEBUG)  # (a flood would flood the log too)

    def _read(self, selector: selectors.BaseSelector, opening: _Opening) -> None:
        try:
            data = opening.sock.recv(OPENING_BYTES - len(opening.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # closed before its opening was whole
            self._drop(selector, opening, "closed before presenting a capability")
            return
        opening.received += data
        if len(opening.received) == OPENING_BYTES:
            selector.unregister(opening.sock)  # nothing more is read until its call has it

    def _settle(self, selector: selectors.BaseSelector) -> None:
        """Hand each whole opening to the call that registered its capability; close those that presented anything
        else, a capability already used or void, or that ran out of time."""
        now = time.monotonic()
        for opening in list(self._openings.values()):
            if len(opening.received) < OPENING_BYTES:
                if now >= opening.deadline:
                    self._drop(selector, opening, "presented no capability in time")
                continue
            presented = opening.capability
            with self._lock:
                void = presented is None or presented in self._voided
                capability = presented
                if presented is not None and self.sealed and opening.sock.family != socket.AF_UNIX:
                    # A sealed TCP lane opens with the capability's derived opening; the capability itself, which
                    # keys its frames, must never cross the network, and opens nothing there. An opening whose call
                    # has not registered it yet waits, as a plain one does.
                    capability = self._sealed_openings.get(presented)
                    void = void or presented in self._expected
                waiting = self._expected.pop(capability, None) if capability is not None else None
                if waiting is not None and not waiting.closed:
                    self._void(waiting.capability)  # single-use: a second connection presenting it is refused at once
                    self._forget_sealed_opening(waiting)
                    del self._openings[opening.sock]
                    opening.sock.setblocking(True)
                    if opening.sock.family != socket.AF_UNIX:
                        tune(opening.sock)
                    waiting.sock = opening.sock
                    waiting.arrived.set()
                    continue
            if void or now >= opening.deadline:
                self._drop(selector, opening, "presented no valid capability")

    def _drop(self, selector: selectors.BaseSelector, opening: _Opening, why: str, level: int = logging.INFO) -> None:
        logger.log(level, "a lane connection %s: closed", why)
        if opening.sock in selector.get_map():
            selector.unregister(opening.sock)
        del self._openings[opening.sock]
        sockets.close(opening.sock)
