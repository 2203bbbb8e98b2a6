"""What vLLM's CPU build decides by the CPU it runs on, asked of vLLM's own code, and those decisions driven both ways
where this machine's CPU cannot show them.

vLLM decides by what torch reports of the CPU (`torch.cpu._is_avx512_supported`, `_is_avx512_bf16_supported`,
`_is_amx_tile_supported`): in `CpuPlatform.check_and_update_config` the recurrent state's dtype (with AVX-512 BF16,
`mamba_ssm_cache_dtype` is reset to float32 unless the accelerated GDN backend takes the one asked) and the MLA block
size, in `CpuPlatform.get_attn_backend_cls` the MLA backend (AMX_MLA with AMX tiles, else CPU_MLA), and in
`cpu_attn._get_attn_isa` the attention kernel (`amx` for bfloat16 in blocks of 32 with AMX tiles). docs/vllm.md#cpus.

    state_dtype(model_dir)                         the dtype vLLM allocates the model's recurrent state in, here
    state_dtype(model_dir, {"avx512_bf16": True})  ... as on a CPU with AVX-512 BF16
    deciding_as({"amx": True})                     in an engine's process: vLLM's platform decisions (not its
                                                   kernels) see AMX tiles (tests/vllm_roles.py's `cpu` setting)

Only the decisions are driven: a kernel still runs on what the CPU has (one using a feature it lacks would die of
SIGILL), so `deciding_as` wraps the two platform methods alone, never the kernels' own checks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

DETECTORS = {
    "avx512": "_is_avx512_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "amx": "_is_amx_tile_supported",
}
"""The CPU features vLLM's CPU build decides by, each with the torch.cpu function it asks."""

DECISIONS = ("check_and_update_config", "get_attn_backend_cls")
"""The CpuPlatform methods that decide by the features (module docstring)."""


@contextlib.contextmanager
def cpu_reports(features: Mapping[str, bool]) -> Iterator[None]:
    """Within the block, torch reports `features` (names of DETECTORS) as given; the CPU's own answers after it."""
    import torch

    saved = {DETECTORS[feature]: getattr(torch.cpu, DETECTORS[feature]) for feature in features}
    try:
        for feature, present in features.items():
            setattr(torch.cpu, DETECTORS[feature], lambda present=present: bool(present))
        yield
    finally:
        for name, detector in saved.items():
            setattr(torch.cpu, name, detector)


@contextlib.contextmanager
def deciding(features: Mapping[str, bool]) -> Iterator[None]:
    """Within the block, vLLM's CPU platform decisions (DECISIONS) see `features`; nothing else does (an import of
    vLLM's kernels under a driven AVX-512 would load its AVX-512 build here and die of SIGILL)."""
    from vllm.platforms.cpu import CpuPlatform

    saved = {name: CpuPlatform.__dict__[name] for name in DECISIONS}
    deciding_as(features)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(CpuPlatform, name, method)


def deciding_as(features: Mapping[str, bool]) -> None:
    """In this process from now on, vLLM's CPU platform decisions (DECISIONS) see `features`; its kernels do not."""
    from vllm.platforms.cpu import CpuPlatform

    for name in DECISIONS:
        decide = getattr(CpuPlatform, name).__func__

        def decided(cls, *args: Any, _decide=decide, **kwargs: Any) -> Any:
            with cpu_reports(features):
                return _decide(cls, *args, **kwargs)

        setattr(CpuPlatform, name, classmethod(decided))


def engine_config(model_dir: Path, features: Mapping[str, bool] | None = None, **engine: Any) -> Any:
    """vLLM's VllmConfig for the model as its own config code makes it on this CPU (or as if it had `features`): the
    environment variables vLLM's platform sets meanwhile (LD_PRELOAD among them) are put back."""
    from vllm.engine.arg_utils import EngineArgs

    arguments = {"dtype": "bfloat16", "max_model_len": 1024, "enforce_eager": True, **engine}
    environment = dict(os.environ)
    try:
        with deciding(features or {}):
            return EngineArgs(model=str(model_dir), skip_tokenizer_init=True, **arguments).create_engine_config()
    finally:
        os.environ.clear()
        os.environ.update(environment)


@functools.cache
def _state_dtype(model_dir: str, dtype: str, features: str) -> str:
    config = engine_config(Path(model_dir), json.loads(features), dtype=dtype)
    model = config.model_config
    cls, _ = model.registry.resolve_model_cls(model.architecture, model_config=model)
    return str(cls.get_mamba_state_dtype_from_config(config)[-1]).removeprefix("torch.")


def state_dtype(model_dir: Path, features: Mapping[str, bool] | None = None, dtype: str = "bfloat16") -> str:
    """The dtype vLLM allocates the hybrid model's recurrent state in (its state calculator on the config vLLM's
    platform makes), on this CPU or as if it had `features`: the broker's contract must have it
    (`--config-state-dtype`)."""
    return _state_dtype(str(model_dir), dtype, json.dumps(dict(features or {}), sort_keys=True))
