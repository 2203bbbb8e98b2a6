"""handoff-broker as a vLLM KV connector (vLLM's v1 API): a prefill instance pushes each prompt's KV to the broker,
a decode instance pulls it into its own pages — whatever block size or attention backend either uses.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "HandoffConnector",
        "kv_connector_module_path": "handoff_client.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"target": "127.0.0.1:50051", "model": "my-model"}}'

`kv_role`: kv_producer on the prefill instance, kv_consumer on the decode instance. vLLM's P/D convention: the
router asks the prefill instance for a hand-off with `kv_transfer_params` {"do_remote_decode": true} (only such
requests are pushed; every other one runs untouched); the output's `kv_transfer_params` carry {"do_remote_prefill":
true, handoff_id, position, model, ticket, prompt_digest}, which the router passes to the decode instance's request,
whose first `position` tokens are then pulled instead of computed, once the prompt's digest is checked
(examples/proxy.py; every field: docs/vllm.md). Settings: _settings.py. Needs the `vllm` extra: `pip install
'.[vllm]'` in a clone (vLLM 0.32.x: _compat.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HandoffConnector"]


def __getattr__(name: str) -> Any:
    """`HandoffConnector` is imported when vLLM asks for it, so the page layouts (_layouts, _pages, _mla_pages,
    _state_pages: torch only) import where vLLM is not installed (benchmarks/gpu_pages.py on a bare GPU machine)."""
    if name == "HandoffConnector":
        from ._connector import HandoffConnector

        return HandoffConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
