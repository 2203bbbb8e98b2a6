"""The vLLM connector's page path on a GPU, without vLLM: CUDA pages in vLLM 0.32's shapes and strides, copied out
and scattered in through a broker on this machine's CPU, checked bit for bit, and timed against plain torch copies.

    python benchmarks/gpu_pages.py                       # on a CUDA machine (exits 0, saying why, where none is)
    python benchmarks/gpu_pages.py --device cpu --quick  # the same path on CPU tensors: a smoke run, no figures
    python benchmarks/gpu_pages.py --describe benchmarks/gpu_pages_layouts.json   # where vLLM 0.32 is installed

A GPU machine without network needs this package's dependencies as wheels (it has torch, numpy, grpcio): fetched
here for its Python (3.10 to 3.13: about 15 MB each, numpy left out),

    pip download -d dist/gpu-wheels/py3.12 --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 'grpcio==1.85.3' 'grpcio-status==1.85.3' 'grpcio-health-checking==1.85.1' \
        'grpcio-reflection==1.85.1' 'protobuf==7.36.2' prometheus-client cryptography ml_dtypes crc32c setuptools wheel
    rm dist/gpu-wheels/*/numpy-*            # keep the machine's own numpy, which its torch was built with

and installed there from the repository root: `python3 -m pip install --no-index --find-links
dist/gpu-wheels/py$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])') '.[server]'`.

vLLM is not needed where it runs: what it must know of vLLM comes from benchmarks/gpu_pages_layouts.json, written by
`--describe` from the installed vLLM's own code (each KVCacheLayout's stride order, the per-layer view strides vLLM
makes for a reference model, whether it cuts blocks into kernel blocks, the orientation of GDN and Mamba2 states),
and every stride this script computes is first checked against the strides recorded there.

What runs, per hand-off, as the connector's worker runs it (_worker.py): the "step" writes the prompt's rows into the
producer's pages on the default stream (behind a deliberate delay, so a copy that did not wait would read stale
rows); an event is recorded at the step's end; on a stream of its own the worker waits for the event, gathers each
layer's rows through the connector's layouts (_pages.FlashLayout, _mla_pages.LatentLayout,
_state_pages.StatePageLayout) and copies them to the host, then pushes; the decoder pulls and scatters each tensor
into its own pages on its own stream. Checked: every row read back from the decoder's pages equals the producer's,
bit for bit, across block sizes 16 -> 64 and 64 -> 16, under all six KVCacheLayouts (and kernel blocks), plus a
hybrid's GDN state page beside its attention layer, and an MLA latent page. Timed (medians): copy-out (gather + to
host) and scatter-in (to device + scatter) in GiB/s, each against a plain torch copy of the same bytes (one
contiguous tensor to the host, and back), in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from handoff_client import HandoffClient, contract_from_config, from_numpy, to_numpy
from handoff_client.vllm._layouts import Geometry
from handoff_client.vllm._mla_pages import LatentGeometry, LatentLayout
from handoff_client.vllm._pages import FlashLayout
from handoff_client.vllm._state_pages import Orientation, StateTensor, state_layout

LAYOUTS_FILE = Path(__file__).with_name("gpu_pages_layouts.json")
GiB = 1 << 30
HANDOFF_IDS = itertools.count()
DTYPE = torch.bfloat16
DENSE = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "num_hidden_layers": 4}  # fmt: skip
LATENT = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 2, "kv_lora_rank": 512,
          "qk_rope_head_dim": 64}  # fmt: skip
HYBRID = {"model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 16,
          "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 2, "linear_conv_kernel_dim": 4,
          "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
          "linear_num_value_heads": 32}  # fmt: skip


# -- --describe: what vLLM 0.32 does, recorded where vLLM is installed ---------------------------------------------


def describe(out: Path) -> None:
    import vllm
    from handoff_client.vllm._orientation import learn_transposed
    from vllm.v1.kv_cache_interface import KVCacheLayout

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import vllm_pages  # the test helpers that allocate through vLLM's own code

    heads, dim, block, blocks = 2, 64, 32, 4
    layouts = {}
    for layout in KVCacheLayout:
        entry = {"stride_order": list(layout.value), "views": []}
        for kernel in (block, block // 2):
            try:
                pages = vllm_pages.attention_pages(layout.name, heads, dim, block, kernel, blocks, layers=3)
            except ValueError:  # vLLM does not cut this layout's blocks
                continue
            entry["views"].append({"layers": 3, "blocks": blocks, "heads": heads, "block": kernel, "width": 2 * dim,
                                   "manager_block": block, "shape": list(pages.shape),
                                   "stride": list(pages.stride())})  # fmt: skip
        layouts[layout.name] = entry
    mamba = {kind: {"transposed": learn_transposed(kind)} for kind in ("GDN_ATTN", "MAMBA2")}
    out.write_text(json.dumps({"vllm": vllm.__version__, "kv_cache_layouts": layouts, "mamba": mamba}, indent=1))
    print(f"wrote {out}: {len(layouts)} KVCacheLayouts from vLLM {vllm.__version__}")


# -- pages in a layout's strides, without vLLM -------------------------------------------------------------------------


def view_strides(order: list[int], layers: int, blocks: int, heads: int, block: int, width: int) -> list[int]:
    """Element strides of a layer's [blocks, heads, block, width] view whose [L, B, H, N, C] axes lie in memory in
    `order` (outermost first): KVCacheLayout's stride permutation, densely packed."""
    shape = (layers, blocks, heads, block, width)
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim], step = step, step * shape[dim]
    return strides


def check_strides(described: dict) -> None:
    """Every view recorded from vLLM must come out of view_strides, else stop: this machine would test other pages."""
    for name, entry in described["kv_cache_layouts"].items():
        for v in entry["views"]:
            ratio = v["manager_block"] // v["block"]
            mine = view_strides(
                entry["stride_order"], v["layers"], v["blocks"] * ratio, v["heads"], v["block"], v["width"]
            )
            if mine[1:] != v["stride"]:
                sys.exit(f"{name}: strides {mine[1:]} computed here differ from vLLM's {v['stride']}")


def attention_pages(order: list[int], layers: int, blocks: int, heads: int, block: int, width: int, device):
    strides = view_strides(order, layers, blocks, heads, block, width)
    raw = torch.zeros(layers * blocks * heads * block * width, dtype=DTYPE, device=device)
    return [raw.as_strided((blocks, heads, block, width), strides[1:], layer * strides[0]) for layer in range(layers)]


# -- the worker's path -----------------------------------------------------------------------------------------------


class Side:
    """The worker's own stream (a no-op on CPU): copies after `after`, waited for at the block's end."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def run(self, fn, after=None):
        if self.stream is None:
            return fn()
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            result = fn()
        self.stream.synchronize()
        return result


def step(write, device: torch.device):
    """The step: `write` queued on the current stream behind ~10 ms of GPU time, then its end's event (a copy that
    did not wait for the event would read the pages before the rows are in them)."""
    if device.type != "cuda":
        write()
        return None
    torch.cuda._sleep(20_000_000)
    write()
    event = torch.cuda.Event()
    event.record()
    return event


def handoff(client: HandoffClient, model: str, hid: str, rows: int, write, copy_out, scatter_in, side: Side, device):
    """The step's write, copy-out after its event, push, pull, scatter each tensor in; (copy-out s, scatter-in s)."""
    hid = f"{hid}-{next(HANDOFF_IDS)}"
    event = step(write, device)
    started = time.perf_counter()
    tensors = side.run(copy_out, after=event)
    copied = time.perf_counter() - started
    client.push(model, hid, rows, tensors)
    arrived = {carried.name: array for carried, array in client.pull_tensors(model, hid, timeout=60)}
    started = time.perf_counter()
    side.run(lambda: scatter_in(arrived))
    return copied, time.perf_counter() - started


def rows_on_host(tensor: torch.Tensor):
    return to_numpy(tensor.cpu())


def ids_for(tokens: int, block: int, spare: int = 2) -> tuple[int, list[int]]:
    """(blocks to allocate, the request's block ids: out of order, never block 0)."""
    need = math.ceil(tokens / block)
    return need + spare, list(range(need + spare - 1, spare - 1, -1))[:need]


def attention_case(client, contract, order, from_block, to_block, tokens, side, device, kernel=0, seed=0):
    """One dense hand-off between two block sizes under one layout; (bytes, copy-out s, scatter-in s)."""
    names = [
        (c.name, contract.carried[i + 1].name) for i, c in enumerate(contract.carried) if c.name.endswith("k_cache")
    ]
    heads, dim = contract.carried[0].heads, contract.carried[0].head_dim
    n_from, ids_from = ids_for(tokens, from_block)
    n_to, ids_to = ids_for(tokens, to_block)
    k_from = kernel or from_block
    src = attention_pages(order, len(names), n_from * (from_block // k_from), heads, k_from, 2 * dim, device)
    dst = attention_pages(order, len(names), n_to, heads, to_block, 2 * dim, device)
    out_layout = FlashLayout(Geometry(heads, dim, from_block, kernel), "FLASH_ATTN")
    in_layout = FlashLayout(Geometry(heads, dim, to_block), "FLASH_ATTN")
    g = torch.Generator(device=device).manual_seed(seed)
    want = {}
    for k, v in names:
        want[k] = torch.randn(tokens, heads * dim, generator=g, device=device).to(DTYPE)
        want[v] = torch.randn(tokens, heads * dim, generator=g, device=device).to(DTYPE)

    def write():  # the step's write, on the default stream
        for pages, (k, v) in zip(src, names):
            out_layout.scatter(pages, ids_from, 0, want[k], want[v])

    def copy_out():
        out = {}
        for pages, (k, v) in zip(src, names):
            keys, values = out_layout.gather(pages, ids_from, tokens)
            out[k], out[v] = rows_on_host(keys), rows_on_host(values)
        return out

    def scatter_in(arrived):
        for pages, (k, v) in zip(dst, names):
            in_layout.scatter(pages, ids_to, 0, from_numpy(arrived[k]).to(device), from_numpy(arrived[v]).to(device))

    copied, scattered = handoff(client, contract.model, f"attn-{seed}", tokens, write, copy_out, scatter_in, side,
                                device)  # fmt: skip
    for pages, (k, v) in zip(dst, names):
        keys, values = in_layout.gather(pages, ids_to, tokens)
        same(keys, want[k], k)
        same(values, want[v], v)
    return 2 * len(names) * tokens * heads * dim * 2, copied, scattered


def same(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        sys.exit(f"FAILED: {name} differs after the round trip")


def latent_case(client, contract, from_block, to_block, tokens, side, device):
    width = contract.carried[0].cols
    n_from, ids_from = ids_for(tokens, from_block)
    n_to, ids_to = ids_for(tokens, to_block)
    layers = [c.name for c in contract.carried]
    src = {n: torch.zeros(n_from, 1, from_block, width, dtype=DTYPE, device=device) for n in layers}
    dst = {n: torch.zeros(n_to, 1, to_block, width, dtype=DTYPE, device=device) for n in layers}
    out_layout, in_layout = (
        LatentLayout(LatentGeometry(width, from_block), "MLA"),
        LatentLayout(LatentGeometry(width, to_block), "MLA"),
    )
    want = {n: torch.randn(tokens, width, device=device).to(DTYPE) for n in layers}
    write = lambda: [out_layout.scatter(src[n], ids_from, 0, want[n]) for n in layers]
    copy_out = lambda: {n: rows_on_host(out_layout.gather(src[n], ids_from, tokens)) for n in layers}

    def scatter_in(arrived):
        for n in layers:
            in_layout.scatter(dst[n], ids_to, 0, from_numpy(arrived[n]).to(device))

    handoff(client, contract.model, f"mla-{from_block}", tokens, write, copy_out, scatter_in, side, device)
    for n in layers:
        same(in_layout.gather(dst[n], ids_to, tokens), want[n], n)


def hybrid_case(client, contract, described, order, tokens, side, device):
    """Layer 0 a GDN state page (padded, as a hybrid's are), layer 1 full attention, block 64 -> 16."""
    state = [c for c in contract.of_layer(0)]
    k_heads, v_heads, k_dim, v_dim = 16, 32, 128, 128
    conv_shape = (3, 2 * k_heads * k_dim + v_heads * v_dim)
    transposed = described["mamba"]["GDN_ATTN"]["transposed"]
    ssm_shape = (v_heads, v_dim, k_dim) if transposed else (v_heads, k_dim, v_dim)
    layout = state_layout([StateTensor(c.name, c.rows, c.cols, c.heads, c.head_dim) for c in state],
                          [conv_shape, ssm_shape], [DTYPE, torch.float32], conv_dim_first=False,
                          orientation=Orientation.TRANSPOSED if transposed else Orientation.AS_IS,  # (a GPU's)
                          layer="layers.0")  # fmt: skip
    content = math.prod(conv_shape) * 2 + math.prod(ssm_shape) * 4
    pages = [torch.zeros(6, 2 * content, dtype=torch.int8, device=device)[:, :content].view(6, 1, 1, content)
             for _ in range(2)]  # fmt: skip
    conv, ssm = layout.views(pages[0])
    conv_rows, states = torch.randn(conv_shape, device=device).to(DTYPE), torch.randn(ssm_shape, device=device)
    attn = list(contract.of_layer(1))
    heads, dim = attn[0].heads, attn[0].head_dim
    _, ids_from = ids_for(tokens, 64)
    _, ids_to = ids_for(tokens, 16)
    src = attention_pages(order, 1, ids_for(tokens, 64)[0], heads, 64, 2 * dim, device)[0]
    dst = attention_pages(order, 1, ids_for(tokens, 16)[0], heads, 16, 2 * dim, device)[0]
    out_layout, in_layout = (
        FlashLayout(Geometry(heads, dim, 64), "FLASH_ATTN"),
        FlashLayout(Geometry(heads, dim, 16), "FLASH_ATTN"),
    )
    keys, values = (torch.randn(tokens, heads * dim, device=device).to(DTYPE) for _ in range(2))

    def write():  # the step: the state block's new state, the attention layer's rows
        conv[4], ssm[4] = conv_rows, states
        out_layout.scatter(src, ids_from, 0, keys, values)

    def copy_out():
        out = {n: rows_on_host(t) for n, t in layout.gather(pages[0], 4).items()}
        k, v = out_layout.gather(src, ids_from, tokens)
        out[attn[0].name], out[attn[1].name] = rows_on_host(k), rows_on_host(v)
        return out

    def scatter_in(arrived):
        layout.scatter(pages[1], 2, {c.name: from_numpy(arrived[c.name]).to(device) for c in state})
        in_layout.scatter(
            dst, ids_to, 0, from_numpy(arrived[attn[0].name]).to(device), from_numpy(arrived[attn[1].name]).to(device)
        )

    handoff(client, contract.model, "hybrid", tokens, write, copy_out, scatter_in, side, device)
    got_conv, got_ssm = layout.views(pages[1])
    same(got_conv[2], conv[4], "conv state")
    if not torch.equal(got_ssm[2].view(torch.int32), ssm[4].view(torch.int32)):
        sys.exit("FAILED: the recurrent state differs after the round trip")
    got_k, got_v = in_layout.gather(dst, ids_to, tokens)
    same(got_k, keys, "hybrid keys")
    same(got_v, values, "hybrid values")


def baseline(nbytes: int, device: torch.device) -> tuple[float, float]:
    """Seconds of a plain torch copy of `nbytes` to the host and back, one contiguous tensor (on CPU: a clone)."""
    data = torch.empty(nbytes // 2, dtype=DTYPE, device=device)
    started = time.perf_counter()
    host = data.cpu() if device.type == "cuda" else data.clone()
    out = time.perf_counter() - started
    started = time.perf_counter()
    host.to(device) if device.type == "cuda" else host.clone()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="small sizes, one timed run (figures not meaningful)")
    parser.add_argument("--layouts", type=Path, default=LAYOUTS_FILE)
    parser.add_argument("--describe", type=Path, help="write the layouts file from the installed vLLM and stop")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if args.describe:
        return describe(args.describe)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"skipped: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "run with --device cpu for the CPU smoke run")  # fmt: skip
        return
    device = torch.device(args.device)
    described = json.loads(args.layouts.read_text())
    check_strides(described)
    from handoff_broker.app import BrokerConfig, build_server

    dense_layers = 2 if args.quick else 32
    contracts = {c.model: c for c in (
        contract_from_config({**DENSE, "num_hidden_layers": dense_layers}, model="dense", ctx=8192),
        contract_from_config(LATENT, model="latent", ctx=8192),
        contract_from_config(HYBRID, model="hybrid", ctx=8192),
    )}  # fmt: skip
    broker, port = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts=contracts, max_bytes=8 * GiB))
    broker.start()
    side = Side(device)
    try:
        with HandoffClient(f"127.0.0.1:{port}", timeout=120) as client:
            tokens = 100 if args.quick else 300
            for name, entry in described["kv_cache_layouts"].items():
                order = entry["stride_order"]
                attention_case(client, contracts["dense"], order, 16, 64, tokens, side, device, seed=1)
                attention_case(client, contracts["dense"], order, 64, 16, tokens, side, device, seed=2)
                cut = len(entry["views"]) > 1  # vLLM cuts this layout's blocks: 64-token blocks of 16-token pages
                if cut:
                    attention_case(client, contracts["dense"], order, 64, 16, tokens, side, device, kernel=16, seed=3)
                print(f"{name}: bit-exact, blocks 16 -> 64 and 64 -> 16{' and kernel blocks' if cut else ''}")
            latent_case(client, contracts["latent"], 16, 64, tokens, side, device)
            latent_case(client, contracts["latent"], 64, 16, tokens, side, device)
            print("MLA latent: bit-exact, blocks 16 -> 64 and 64 -> 16")
            hybrid_case(client, contracts["hybrid"], described, described["kv_cache_layouts"]["LBHNC"]["stride_order"],
                        tokens, side, device)  # fmt: skip
            print("GDN state page + attention layer: bit-exact, block 64 -> 16")
            timed(
                client,
                contracts["dense"],
                described,
                side,
                device,
                512 if args.quick else 4096,
                1 if args.quick else args.runs,
            )
    finally:
        broker.stop(grace=0.5)


def timed(client, contract, described, side, device, tokens, runs) -> None:
    order = described["kv_cache_layouts"]["LBHNC"]["stride_order"]
    results = [attention_case(client, contract, order, 16, 64, tokens, side, device, seed=10 + i) for i in range(runs)]
    nbytes = results[0][0]
    out = statistics.median(r[1] for r in results)
    into = statistics.median(r[2] for r in results)
    plain = [baseline(nbytes, device) for _ in range(runs)]
    plain_out, plain_in = statistics.median(p[0] for p in plain), statistics.median(p[1] for p in plain)
    layers = len(contract.carried) // 2
    print(f"{contract.model}: {layers} layers x {tokens} tokens = {nbytes / GiB:.3f} GiB, median of {runs}")
    for what, ours, plain_s in (("copy-out   (gather + to host)", out, plain_out),
                                ("scatter-in (to device + scatter)", into, plain_in)):  # fmt: skip
        print(f"  {what:34} {nbytes / ours / GiB:7.2f} GiB/s   plain torch copy {nbytes / plain_s / GiB:7.2f} GiB/s"
              f"   ratio {plain_s / ours:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
