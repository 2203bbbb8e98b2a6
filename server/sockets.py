"""The lane listener's socket helpers: who is at the other end of a connection, whether a Unix socket file is
stale, and closing or draining a socket without raising on one already gone; why a port gRPC could not bind."""

from __future__ import annotations

import os
import socket
import stat
import struct


def peer(sock: socket.socket) -> tuple[int, int]:
    """The process and the user at the other end of a Unix socket (as the kernel saw it connect)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def address(sock: socket.socket) -> str:
    """The peer's address (without its port) of a TCP connection: the source whose openings are counted together."""
    try:
        return str(sock.getpeername()[0])
    except OSError:  # gone already
        return "?"


def stale_socket(path: str) -> bool:
    """A socket file at `path` that nothing listens on any more."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except FileNotFoundError:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()


def family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, InterruptedError, OSError):
        pass


def bind_error(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on ("Address already in use", "Cannot assign requested address", ...),
    found by binding it ourselves; None where it can (gRPC's failure was something else)."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(info[0], info[1]) as probe:
            probe.bind(info[4])
    except OSError as e:
        return e.strerror or str(e)
    return None
