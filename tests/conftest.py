"""Fixtures: a real broker on a loopback port, started per test and always stopped, and clients for it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from handoff_broker import Broker, BrokerConfig, build_server
from handoff_broker.contracts import load_contracts
from handoff_client import Contract, HandoffClient

MANIFESTS = Path(__file__).parent / "manifests"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where a collected module starts vLLM engines (it imported tests/engine_zygote.py, through vllm_driver or
    vllm_serve), the zygote they fork from starts now, its imports overlapping the tests before them."""
    if "engine_zygote" in sys.modules and session.items and not session.config.option.collectonly:
        sys.modules["engine_zygote"].start()


@pytest.hookimpl(trylast=True)  # (after pytest's runner has torn down what -x or Ctrl-C left set up)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """The zygote stopped, with any engine forked from it still running (each test's own are stopped already)."""
    if "engine_zygote" in sys.modules:
        sys.modules["engine_zygote"].stop()


@pytest.fixture(scope="session")
def contracts() -> dict[str, Contract]:
    return load_contracts(MANIFESTS)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM tests' tiny random-weight Llama (tests/tiny_models.build_tiny_llama), built once for every module
    that runs it. Read only: a test that needs another model builds its own."""
    from tiny_models import build_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_llama(folder)
    return folder


PATHS: dict[str, dict[str, object]] = {
    "default": {},  # as a broker serves by default: large hand-offs on a lane (these clients, on the broker's host,
    # take its shared-memory lane from 16 MiB, its TCP lane from 1 MiB), small ones on the stream
    "stream": {"lanes": False},  # every byte on the gRPC streams
    "tcp": {"lane_min_bytes": 1, "shared_memory_lane": False},  # all a client can send on a lane, on the TCP lane
    "shm": {"lane_min_bytes": 1, "shared_memory_lane_min_bytes": 1},  # ... on the shared-memory lane
}
"""The paths a hand-off's bytes can take. A test module that sets `EVERY_PATH = True` runs each of its tests once on
each of "stream", "tcp" and "shm" (the brokers it starts serve that path), so each lane keeps every promise the
stream makes; on a lane's path a call that fell back to the stream fails its test (`stays_on_its_lane`)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if getattr(metafunc.module, "EVERY_PATH", False) and "path" in metafunc.fixturenames:
        metafunc.parametrize("path", ["stream", "tcp", "shm"])


@pytest.fixture
def path() -> str:
    return "default"


@pytest.fixture(autouse=True)
def stays_on_its_lane(request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """On a lane's path, a test fails if any of its calls fell back to the stream (the client's `lane_fallback`
    warning): a lane that broke would otherwise pass unseen, the client's retry on the stream delivering the same
    bits. (Tests that break a lane on purpose live in test_lanes.py and test_shm_lane.py, which run on one path.)"""
    yield
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("path") not in ("tcp", "shm"):
        return
    records = caplog.get_records("setup") + caplog.get_records("call")
    fallbacks = [r.getMessage() for r in records if getattr(r, "lane_fallback", False)]
    assert not fallbacks, f"a call left its lane for the stream: {fallbacks}"


@pytest.fixture
def start_broker(contracts: dict[str, Contract], path: str) -> Iterator[Callable[..., Broker]]:
    """Start brokers with any config overrides; every one is stopped when the test ends."""
    started: list[Broker] = []

    def start(**overrides: object) -> Broker:
        config = BrokerConfig(**{"host": "127.0.0.1", "port": 0, "contracts": contracts, **PATHS[path], **overrides})
        broker, _ = build_server(config)
        started.append(broker.start())
        return broker

    yield start
    for broker in started:
        broker.stop(grace=0.2)


@pytest.fixture
def broker(start_broker: Callable[..., Broker]) -> Broker:
    return start_broker()


@pytest.fixture
def client(broker: Broker) -> Iterator[HandoffClient]:
    with HandoffClient(broker.address, timeout=20) as c:
        yield c


def seeded_tensors(contract: Contract, seed: int = 0) -> dict[str, np.ndarray]:
    """Random bits for every carried tensor (NaNs and all: a hand-off moves bits, not numbers)."""
    rng = np.random.default_rng(seed)
    return {
        c.name: rng.integers(0, 256, size=c.nbytes, dtype=np.uint8).view(c.numpy_dtype).reshape(c.shape)
        for c in contract.carried
    }


def bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def assert_same_bits(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, wanted in want.items():
        assert got[name].shape == wanted.shape, name
        assert got[name].dtype == wanted.dtype, name
        assert bits(got[name]) == bits(wanted), name


def assert_holds_nothing(broker: Broker, within: float = 0.0) -> None:
    """No hand-off in any phase, no byte reserved (`within`: by then, for a call its client ended, which the broker's
    own thread for it frees as soon as it hears)."""
    deadline = time.monotonic() + within
    stats = broker.store.stats()
    while stats.receiving + stats.ready + stats.claimed + stats.resident_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
        stats = broker.store.stats()
    assert (stats.receiving, stats.ready, stats.claimed, stats.resident_bytes) == (0, 0, 0, 0), stats
