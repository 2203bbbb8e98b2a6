"""The connector vLLM loads: one class, two halves by role (the scheduler half decides, the worker half moves the
bytes), as vLLM's own connectors are built. Every method here only routes to its half; see _scheduler.py and
_worker.py for what each guarantees.

It is `SupportsHMA`: vLLM keeps its hybrid KV-cache manager on, so hybrid models (gated-delta-net, Mamba2) start and
sliding-window groups keep only their window's blocks; every block id list is then one list per KV-cache group
(_groups.py). `request_finished` stays for an engine started with --disable-hybrid-kv-cache-manager (one group)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ._compat import check_vllm
from ._groups import engine_state_dtype, group_map
from ._last_token import check_engine
from ._logs import log_through_vllm
from ._scheduler import HandoffConnectorMetadata, SchedulerHalf
from ._settings import ConnectorSettings, served_contract
from ._stats import HandoffConnectorStats, HandoffPromMetrics
from ._worker import WorkerHalf


class HandoffConnector(KVConnectorBase_V1, SupportsHMA):
    """handoff-broker between a vLLM prefill instance (kv_producer) and a decode instance (kv_consumer)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        check_vllm()  # a vLLM whose connector API this does not know is refused by name, before anything else
        log_through_vllm()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        self.contract = served_contract(vllm_config, self.settings, engine_state_dtype(kv_cache_config))
        self.groups = group_map(kv_cache_config, self.contract)  # refuses, by name, what does not fit
        check_engine(vllm_config, self.contract, self.groups, consumer=transfer.is_kv_consumer)
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerHalf(self.settings, self.contract, self.groups, transfer.engine_id,
                                           transfer.is_kv_producer, transfer.is_kv_consumer,
                                           getattr(kv_cache_config, "hash_block_size", None))  # fmt: skip
        else:
            self.worker = WorkerHalf(self.settings, self.contract, vllm_config, kv_cache_config)

    # -- scheduler side -----------------------------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HandoffConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """One KV-cache group (--disable-hybrid-kv-cache-manager)."""
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.scheduler.request_finished(request)

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34+ (`--max-num-inflight-kv-loads`): whether this request's load may be asynchronous."""
        return self.scheduler.may_load_async(request)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: no. Sleep mode remaps the KV cache under the page views the worker learned and verified at
        start-up, so vLLM's own config check refuses `--enable-sleep-mode` with this connector, naming it."""
        return False

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """None: a load writes only the hand-off's rows, so the rest of its last block, and any block after it, would
        keep whatever bytes a page held before (read back as NaN or Inf where vLLM zeroes: Mamba and mixed-precision
        caches). vLLM zeroes the fresh blocks of the groups not named in the step that sends the load, before
        `start_load_kv` (either model runner), and the load writes after that (on a GPU, its stream waits for it).
        vLLM 0.32's CPU runner zeroes full-attention groups only (`cpu_model_runner._zero_block_ids`): a window
        group's first loaded block keeps, in the slots before the window, what they held (an earlier request's keys
        and values, or the zeros the cache was allocated with), which its attention masks."""
        return ()

    # -- worker side --------------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: HandoffConnectorMetadata) -> None:
        """Before the step's forward pass, on every worker: pages vLLM freed are no longer read by a copy still under
        way, before the forward may write them (vLLM's V1 runner calls this before anything writes them; under its V2
        runner the copy has ended within its own step: _worker.reuses_pages_before_preemptions)."""
        self.worker.wait_for_copies(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """After the forward pass, since this connector's loads are all asynchronous (vLLM starts them then)."""
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM schedules a request only once its pull has finished

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished pushes and loads, and the loads that failed: vLLM recomputes those requests' prompts."""
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(metadata, HandoffConnectorMetadata) and metadata.idle  # (a step that computes nothing)
        return KVConnectorTransferResults(*self.worker.get_finished(finished_req_ids, idle))

    def get_kv_connector_stats(self) -> HandoffConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else self.scheduler.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HandoffConnectorStats:
        return HandoffConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> HandoffPromMetrics:  # fmt: skip
        return HandoffPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def flush(self, timeout: float = 60.0) -> bool:
        """Worker side: wait up to `timeout` s for the pushes under way to end (before a planned exit)."""
        return self.worker.flush(timeout) if self.worker is not None else True

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
