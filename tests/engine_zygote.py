"""vLLM engines forked from a process that has imported torch and vLLM once (a zygote), so that an engine's start-up
skips what was most of it: ~17 s of imports on one core, and as long again where vLLM inspects the model's class in
a fresh interpreter (LLM() itself takes ~3 s for a tiny model here).

    command([sys.executable, SCRIPT, *args])   the argv to Popen instead: a stub that has the zygote run SCRIPT
                                               (or `-m MODULE`, `-c CODE`) in a fork of its own; else the argv
    start()                                    the session's zygote started, not waited for (conftest: once a
                                               collected module uses vLLM, so that its imports overlap the tests)
    stop()                                     the zygote and every engine still forked from it ended

The stub (`python engine_zygote.py run SOCKET ARGV...`, a light process: no torch) stands for the engine where the
tests hold a Popen: the zygote's fork takes the stub's descriptors (each at its own number), environment and working
directory; the stub's exit status is the engine's; SIGTERM and SIGINT sent to the stub go to the engine; and an
engine whose stub is gone (killed, or its test's process) kills itself. So `Engine`, `Served` and a test that kills
an engine see the same process as before. A fork runs its script as `python SCRIPT` would (sys.argv, sys.path[0],
`__main__`) in a process where only vLLM's and torch's imports are done: neither has started a thread or read an
engine's settings (vLLM reads its environment when an engine starts: VLLM_CPU_OMP_THREADS_BIND, VLLM_CACHE_ROOT).
The processes vLLM starts from an engine go through the stub too: multiprocessing's spawn (vLLM's CPU build spawns
each TP rank and `vllm serve`'s engine core) and the model-class inspection (vLLM's registry keeps its command in
`_SUBPROCESS_COMMAND` to be changed where needed).
An engine ends with its zygote too (PR_SET_PDEATHSIG), and a request that fails (its stub gone before it was
served, a failed fork) fails alone: the zygote serves the next.
HANDOFF_TEST_ZYGOTE=0 turns it off (each engine a fresh interpreter, as before); a zygote that fails to start, or
has ended since, does too.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PRELOAD = (
    "torch",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.inputs",
    "vllm.sampling_params",
    "vllm.model_executor.models.registry",
)
"""What the zygote imports before it forks: the heavy part of every engine script and of `vllm serve`."""

_zygote: dict = {}  # this process's zygote: "process", "socket", "folder"; empty until started
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("HANDOFF_TEST_ZYGOTE", "1") != "0"


def start() -> None:
    """The zygote started (once per process), not waited for; nothing where turned off or vLLM is not installed."""
    with _lock:
        if _zygote or not enabled():
            return
        try:
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                return
        except (ImportError, ValueError):
            return
        folder = tempfile.mkdtemp(prefix="handoff-zygote-")
        path = os.path.join(folder, "zygote.sock")
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        with open(os.path.join(folder, "zygote.log"), "w") as log:
            process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env)  # fmt: skip
        _zygote.update(process=process, socket=path, folder=folder, ready=None)


def _ready(timeout: float = 300) -> str | None:
    """The zygote's socket once it has printed a line `ready` (after whatever its imports print); None if it is off,
    failed or has ended since (then every engine starts afresh)."""
    start()
    with _lock:
        if not _zygote:
            return None
        process = _zygote["process"]
        if _zygote["ready"] is None:
            output = _output_until_ready(process.stdout.fileno(), time.monotonic() + timeout)
            _zygote["ready"] = b"\nready\n" in b"\n" + output
            if not _zygote["ready"]:
                print(f"engine_zygote: no zygote, engines start afresh: {output[-1000:]!r} {_log_tail()}",
                      file=sys.stderr)  # fmt: skip
        elif _zygote["ready"] and (process.poll() is not None or not os.path.exists(_zygote["socket"])):
            _zygote["ready"] = False
            print(f"engine_zygote: the zygote ended ({process.returncode}), later engines start afresh: "
                  f"{_log_tail()}", file=sys.stderr)  # fmt: skip
        return _zygote["socket"] if _zygote["ready"] else None


def _output_until_ready(fd: int, deadline: float) -> bytes:
    """What the zygote printed, read until a line `ready`, its end (EOF) or `deadline` (time.monotonic)."""
    output = b""
    while b"\nready\n" not in b"\n" + output:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        output += chunk
    return output


def _log_tail() -> str:
    try:
        with open(os.path.join(_zygote["folder"], "zygote.log")) as log:
            return log.read()[-2000:]
    except OSError:
        return ""


def command(argv: list[str]) -> list[str]:
    """`argv` (`[python, SCRIPT, ...]` or `[python, -m, MODULE, ...]`) run by a fork of the zygote: the stub's argv;
    `argv` itself where there is no zygote."""
    path = _ready()
    if path is None or argv[0] != sys.executable:
        return argv
    return [sys.executable, os.path.abspath(__file__), "run", path, *argv[1:]]


def stop() -> None:
    """The zygote ended, and with it (their stubs' lifelines aside) every engine it forked that still runs."""
    with _lock:
        if not _zygote:
            return
        process = _zygote.pop("process")
        ended(process, timeout=10)
        process.stdout.close()
        shutil.rmtree(_zygote["folder"], ignore_errors=True)
        _zygote.clear()


def ended(process: subprocess.Popen, timeout: float = 30) -> None:
    """Terminated, else killed; waited for."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- the zygote


def serve(path: str) -> None:
    """Import PRELOAD, print `ready`, then fork one engine for each stub that connects; each child's exit status is
    sent to its stub. On SIGTERM: every child still running is killed, then the zygote exits."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    children: dict[int, socket.socket] = {}
    zygote = os.getpid()

    def end(*_: object) -> None:
        if os.getpid() != zygote:  # (a fork before its own handlers: never, SIGTERM being blocked over each fork)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # (its socket and stub: no one else's)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C ends the tests, whose session end stops the zygote)
    parent = os.getppid()
    python = os.path.join(os.path.dirname(path), "python")  # what multiprocessing runs to spawn: this stub
    with open(python, "w") as script:
        script.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.abspath(__file__)}" run "{path}" "$@"\n')
    os.chmod(python, 0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener], [], [], 0.2)
        if os.getppid() != parent:  # the tests' process is gone
            end()
        if readable:
            connection = None
            try:  # (a stub gone before its request or its answer, a failed fork: that stub's alone; the next is served)
                connection, _ = listener.accept()
                _fork([listener, *children.values()], connection, python, children)
            except (OSError, ValueError) as error:
                print(f"engine_zygote: a request failed, the zygote goes on: {error!r}", file=sys.stderr, flush=True)
                if connection is not None:
                    connection.close()
        while children:  # reaped: each ended child's status to its stub
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                connection.close()


def _fork(
    others: list[socket.socket], connection: socket.socket, python: str, children: dict[int, socket.socket]
) -> int:
    """A child running the request on `connection` (its argv, environment, directory and descriptors), closing the
    zygote's `others` sockets, recorded in `children`; the child's pid, sent to the stub too (0 where the request
    could not be read). SIGTERM and SIGINT are blocked over the fork: one the stub forwards at once waits in the child
    until the child's own handlers are set (never the zygote's, which would end its siblings)."""
    connection.settimeout(60)  # (a stub stopped before its request holds the zygote no longer)
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 250)
    connection.settimeout(None)
    try:
        request = json.loads(message)
        complete = len(fds) == len(request["fds"])
    except (ValueError, TypeError, KeyError):  # (b"": the stub ended before its request)
        complete = False
    if not complete:
        for fd in fds:
            os.close(fd)
        connection.close()
        return 0
    parent = os.getpid()
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        for fd in fds:
            os.close(fd)
        raise
    if pid:
        try:
            children[pid] = connection
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            pass  # (the stub is gone: the child's lifeline ends it, reaped as any other)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        return pid
    try:
        _die_with(parent)
        for other in others:
            other.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        lifeline = _descriptors(dict(zip(request["fds"], fds, strict=True)), connection)
        # text streams over the stub's descriptors, for the process's life (line-buffered as python's are)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        threading.Thread(target=_lifeline, args=(lifeline,), daemon=True).start()
        import multiprocessing

        multiprocessing.set_executable(python)  # a spawned process (vLLM's CPU build spawns TP ranks and serve's
        # engine core) is forked from the zygote too, and so is the process in which vLLM inspects a model's class
        # where its cache has no entry for it (the command vLLM keeps for that, to be changed where needed)
        sys.modules["vllm.model_executor.models.registry"]._SUBPROCESS_COMMAND[0] = python
        _run(request["argv"])
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:  # noqa: BLE001 (whatever ended it, the child reports it and exits: never the zygote's loop)
        import traceback

        traceback.print_exc()
        code = 1
    else:
        code = 0
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _die_with(parent: int) -> None:
    """This process killed when `parent` (the zygote) ends, however it ends (PR_SET_PDEATHSIG); ended now if it has."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, ctypes.c_ulong(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # (no prctl: the stub's lifeline still ends the engine with its stub)
    if os.getppid() != parent:
        os._exit(1)


def _descriptors(wanted: dict[int, int], connection: socket.socket) -> socket.socket:
    """This process's descriptors made the stub's, each at its own number (`wanted`: number -> the one received),
    every other one closed, as an exec would leave them; the connection to the stub moved out of their way."""
    high = max([*wanted, 2]) + 100
    lifeline = socket.socket(fileno=fcntl.fcntl(connection.fileno(), fcntl.F_DUPFD_CLOEXEC, high))
    connection.close()
    moved = {number: fcntl.fcntl(fd, fcntl.F_DUPFD, high) for number, fd in wanted.items()}
    for fd in wanted.values():
        os.close(fd)
    for number, fd in moved.items():
        os.dup2(fd, number, inheritable=True)
        os.close(fd)
    keep = {*wanted, lifeline.fileno()}
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass  # (the listing's own descriptor, closed already)
    return lifeline


def _lifeline(connection: socket.socket) -> None:
    """In an engine: when its stub is gone (the stub never sends after its request), the engine ends too."""
    try:
        while connection.recv(4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _run(argv: list[str]) -> None:
    """`python ARGV...` in this process: `SCRIPT ARGS` or `-m MODULE ARGS`, as `__main__`."""
    import runpy

    if argv[0] == "-c":  # (multiprocessing's spawn: `-c 'from multiprocessing.spawn import spawn_main; ...'`)
        import types

        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # noqa: S102 (what `python -c` does)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


# -- the stub


def run(path: str, argv: list[str]) -> int:
    """Have the zygote at `path` run `argv` with this process's descriptors, environment and directory; forward
    SIGTERM and SIGINT to it; its exit status. Python's own flags before the script are those of the zygote (a
    spawn passes the interpreter's: -B where PYTHONDONTWRITEBYTECODE is set)."""
    while argv[0].startswith("-") and argv[0] not in ("-c", "-m"):
        argv = argv[2:] if argv[0] in ("-X", "-W") else argv[1:]
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    fds = sorted(int(name) for name in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if fd != connection.fileno() and _is_open(fd)]
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}
    socket.send_fds(connection, [json.dumps(request).encode()], fds)
    nothing = os.open(os.devnull, os.O_RDWR)  # the engine's pipes held by the engine alone: its end is their end
    for fd in fds:
        if fd > 2:
            os.close(fd)
        else:
            os.dup2(nothing, fd)
    answers = connection.makefile("rb")
    child = json.loads(answers.readline())["pid"]

    def forward(signum: int, _: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    line = answers.readline()
    if not line:  # the zygote is gone: so is the engine
        forward(signal.SIGKILL, None)
        return 1
    code = json.loads(line)["exit"]
    if code < 0:  # ended by a signal: so does the stub, for the Popen that waits on it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
    return code


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(run(sys.argv[2], sys.argv[3:]))
