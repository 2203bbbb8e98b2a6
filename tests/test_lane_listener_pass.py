"""One pass of the lane listener's loop (server/lanes.py, `LaneListener._pass`), driven by hand with real sockets on
loopback, so that events the listener's own thread could only meet by chance meet in one pass, in a chosen order.

The case: every opening is taken, and one select pass reports both a new connection on the listener and data on the
oldest opening. The accept comes first and makes room by closing that oldest opening; its own readiness, later in the
same pass, must be skipped (before 67914ed it was a KeyError, which ended the listener's thread: every lane call
after it waited out its opening deadline and fell back to the stream).
"""

from __future__ import annotations

import selectors
import socket
import time

from handoff_broker.lanes import MAX_OPENINGS, LaneListener
from handoff_client.protocol.lane import CAPABILITY_BYTES, MAGIC


def passes_until(listener: LaneListener, selector: selectors.BaseSelector, done, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the listener did not get there"
        listener._pass(selector, selector.select(0.05))


def test_an_opening_closed_to_make_room_earlier_in_the_same_pass_is_skipped():
    listener = LaneListener(("127.0.0.1", 0))  # (not started: this test is its thread)
    clients: list[socket.socket] = []
    try:
        with selectors.DefaultSelector() as selector:
            listener._watch(selector)
            for _ in range(MAX_OPENINGS):
                clients.append(socket.create_connection(("127.0.0.1", listener.port)))
            passes_until(listener, selector, lambda: len(listener._openings) == MAX_OPENINGS)
            oldest = next(iter(listener._openings))  # the one a new connection's room is made with

            newcomer = socket.create_connection(("127.0.0.1", listener.port))  # the listener is readable...
            clients.append(newcomer)
            clients[0].sendall(MAGIC[:1])  # ... and so is the oldest opening
            wanted = {"listener", oldest}
            deadline = time.monotonic() + 5
            while True:  # (select only looks: a readable socket stays readable until read)
                events = selector.select(0.05)
                if wanted <= {key.data if key.data == "listener" else key.fileobj for key, _ in events}:
                    break
                assert time.monotonic() < deadline, "both events never ready at once"
            events.sort(key=lambda event: event[0].data != "listener")  # the accept first, as epoll may order them

            listener._pass(selector, events)  # before 67914ed: KeyError

            assert oldest not in listener._openings and oldest.fileno() == -1  # closed to make room
            assert len(listener._openings) == MAX_OPENINGS  # the newcomer took its place
            clients[0].settimeout(5)
            assert clients[0].recv(1) == b""  # and the oldest's client sees its connection closed

            # The listener goes on: a call's connection presenting its capability is handed to that call.
            capability = bytes(range(CAPABILITY_BYTES))
            waiting = listener.expect(capability)
            caller = socket.create_connection(("127.0.0.1", listener.port))
            clients.append(caller)
            caller.sendall(MAGIC + capability)
            passes_until(listener, selector, waiting.arrived.is_set)
            assert waiting.wait(0) is not None
            listener.forget(waiting)
    finally:
        for client in clients:
            client.close()
        for opening in list(listener._openings.values()):
            opening.sock.close()
        listener.close()
