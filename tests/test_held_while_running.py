"""A pull's stream slot (server/admission.py, HeldWhileRunning) against grpcio's own server loop: once the call has
ended and the slot is given back, no thread runs the handler again.

grpcio's sync server sends each response, checks that the call is still active, then asks the handler's iterator
for the next one (grpc/_server.py, `_send_message_callback_to_blocking_iterator_adapter`). The client's cancel, and
the done-callbacks it runs (`call_ended`, which gives the slot back when no thread is inside the handler), can land
on another thread between that check and that `next`. The test holds grpcio's thread at exactly that point (on
entering `__next__`, before the wrapper runs) until the call has ended, then lets it go on, as a busy machine's
scheduler may.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from handoff_broker.admission import Budget, HeldWhileRunning

METHOD = "/test.Held/Stream"


class PausedAtNext(HeldWhileRunning):
    """grpcio's thread, stopped on its second `next` until the call has ended (as a busy machine may stop it)."""

    def __init__(self, *args, entered: threading.Event, ended: threading.Event) -> None:
        super().__init__(*args)
        self.calls = 0
        self.entered, self.ended, self.done = entered, ended, threading.Event()

    def __next__(self):
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            assert self.ended.wait(10)
        try:
            return super().__next__()
        finally:
            if self.calls == 2:
                self.done.set()


def test_a_handler_is_not_run_again_once_its_call_has_ended_and_its_slot_is_free():
    budget = Budget("streams", 1)
    entered, ended = threading.Event(), threading.Event()
    ran_after_end: list[int] = []  # the slots taken when the handler ran after its call ended
    closed = threading.Event()
    held: list[PausedAtNext] = []

    def handler_body():
        try:
            yield b"first"
            ran_after_end.append(budget.taken)  # the handler runs here: the thread its slot stands for is busy
            yield b"second"
        finally:
            closed.set()

    def stream(request: bytes, context: grpc.ServicerContext):
        wrapper = PausedAtNext(budget.take(), handler_body(), entered=entered, ended=ended)
        held.append(wrapper)

        def call_ended() -> None:
            wrapper.call_ended()
            ended.set()

        assert context.add_callback(call_ended)
        return wrapper

    server = grpc.server(futures.ThreadPoolExecutor(4))
    handler = grpc.unary_stream_rpc_method_handler(stream)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Held", {"Stream": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(METHOD)(b"", timeout=10)
            assert next(call) == b"first"
            assert entered.wait(5)  # grpcio sent the first response, found the call active, and asks for the next
            call.cancel()
            assert ended.wait(5)
            assert budget.taken == 0  # the call ended with no thread inside the handler: the slot went back
            assert held[0].done.wait(5)
        assert ran_after_end == [], "the handler ran after its call ended, on a thread its free slot stood for"
        assert closed.wait(5)  # and it was closed, there and then, not left for the collector
        assert budget.taken == 0
    finally:
        server.stop(0).wait()
