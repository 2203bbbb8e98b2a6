"""A TCP proxy on loopback that tests use to break a connection the way networks do.

    cut_after(n)   the next connection is closed (RST) once n bytes have crossed it toward the broker or back;
                   with `once`, the proxy then holds the bytes until `once()` is true (the broker has taken in
                   what a test needs it to have), so what a broken stream leaves behind does not hang on how
                   fast the broker's threads happened to run
    freeze()       every connection stops carrying bytes but stays open: a peer gone without a FIN
    record=True    keeps every byte that crosses, both ways, in `recorded`: what a tap on the network would see

It forwards everything else as it is. Every socket and thread it opens, `close` ends.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable


class Proxy:
    def __init__(self, target_port: int, record: bool = False) -> None:
        self.target_port = target_port
        self.recorded: bytearray | None = bytearray() if record else None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.connections = 0
        self.carried: list[int] = []  # bytes each connection carried toward the broker
        self._cut_after: int | None = None
        self._cut_once: Callable[[], bool] | None = None
        self._frozen = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def cut_after(self, n: int, once: Callable[[], bool] | None = None) -> None:
        self._cut_after, self._cut_once = n, once

    def freeze(self) -> None:
        self._frozen.set()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            budget, self._cut_after = self._cut_after, None
            once, self._cut_once = self._cut_once, None
            crossed = [0]
            with self._lock:
                self.connections += 1
                self.carried.append(0)
                self._sockets += [client, upstream]
            index = len(self.carried) - 1
            for src, dst in ((client, upstream), (upstream, client)):
                args = (src, dst, budget, once, crossed, (client, upstream), index if src is client else None)
                t = threading.Thread(target=self._pipe, args=args, daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, src, dst, budget, once, crossed, pair, upstream_index) -> None:
        try:
            while not self._closed.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                if self._frozen.is_set():
                    self._closed.wait()  # hold the bytes and the connection: no FIN, no RST
                    return
                with self._lock:
                    crossed[0] += len(data)
                    if upstream_index is not None:
                        self.carried[upstream_index] += len(data)
                    if self.recorded is not None:
                        self.recorded += data
                    cut = budget is not None and crossed[0] >= budget
                if cut:
                    _wait_for(once, self._closed)
                    for s in pair:
                        _reset(s)
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if not self._frozen.is_set():
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            for s in self._sockets:
                _reset(s)
        for t in self._threads:
            t.join(timeout=5)


def _wait_for(once: Callable[[], bool] | None, closed: threading.Event, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while once is not None and not once() and time.monotonic() < deadline and not closed.wait(0.01):
        pass


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass
