"""The connector's scheduler half: it only decides and builds metadata; the worker half moves the bytes.

Producer (`kv_producer`, `kv_both`): every request whose prompt is fully computed in a step gets a save entry (its
blocks and prompt length) in that step's metadata; after the step the worker copies the prompt's rows out of the
pages and pushes them in the background. `request_finished` holds a saved request's pages (returns True) until the
worker reports the push ended, and hands the router `kv_transfer_params` = {handoff_id, position, model, ticket}.
Each step's metadata also names the requests vLLM preempted in it, whose pages it freed: the worker lets no copy
still read them once the next forward pass may write them.

Consumer (`kv_consumer`, `kv_both`): a request whose `kv_transfer_params` carry a `handoff_id` has its first
`position` prompt tokens loaded asynchronously (vLLM then computes only the last prompt token); the load entry names
the request's freshly allocated blocks, and the worker pulls the hand-off straight into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from handoff_client._contract import Contract
from handoff_client._fleet import make_ticket
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ._settings import ConnectorSettings


@dataclass(frozen=True)
class SaveSpec:
    """Push request `request_id`'s first `rows` tokens (its whole prompt) from `block_ids` as `handoff_id`."""

    request_id: str
    handoff_id: str
    block_ids: tuple[int, ...]
    rows: int


@dataclass(frozen=True)
class LoadSpec:
    """Pull `handoff_id` (a hand-off after `rows` tokens) into `block_ids`, writing tokens [first, rows)."""

    request_id: str
    handoff_id: str
    block_ids: tuple[int, ...]
    first: int
    rows: int


@dataclass
class HandoffConnectorMetadata(KVConnectorMetadata):
    """What one step's worker halves must do: the saves and loads the scheduler half decided, and the requests
    vLLM preempted (their pages freed) in this step."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class SchedulerHalf:
    """Decides which requests are pushed (producer) or pulled (consumer); builds each step's metadata."""

    def __init__(self, settings: ConnectorSettings, contract: Contract, engine_id: str, producer: bool,
                 consumer: bool) -> None:  # fmt: skip
        self.settings = settings
        self.contract = contract
        self.engine_id = engine_id
        self.producer = producer
        self.consumer = consumer
        self._blocks: dict[str, list[int]] = {}  # producer: each unsaved request's blocks so far
        self._prompt: dict[str, int] = {}
        self._saved: dict[str, int] = {}  # producer: request -> rows pushed
        self._loads: dict[str, LoadSpec] = {}
        self._loaded: set[str] = set()

    def handoff_id(self, request_id: str) -> str:
        """Request ids are the engine's own (an offline run numbers them from 0): the engine id makes them unique."""
        return f"{self.engine_id}-{request_id}"

    # -- consumer -----------------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not self.consumer or "handoff_id" not in params or request.request_id in self._loaded:
            return 0, False
        rows = min(int(params["position"]), request.num_prompt_tokens)
        count = rows - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or request.request_id in self._loaded:
            return
        params = request.kv_transfer_params
        first = request.num_computed_tokens  # a local prefix-cache hit is not overwritten
        self._loads[request.request_id] = LoadSpec(
            request.request_id, str(params["handoff_id"]), tuple(blocks.get_block_ids()[0]), first,
            first + num_external_tokens,
        )  # fmt: skip
        self._loaded.add(request.request_id)

    # -- producer -----------------------------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> HandoffConnectorMetadata:
        meta = HandoffConnectorMetadata(loads=list(self._loads.values()))
        meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        self._loads.clear()
        if not self.producer:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            self._prompt[new.req_id] = len(new.prompt_token_ids or [])
            self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if request_id not in self._blocks:
                continue
            if cached.new_block_ids[i] is not None:
                self._blocks[request_id] += cached.new_block_ids[i][0]
            self._maybe_save(meta, request_id, cached.num_computed_tokens[i] + scheduled.get(request_id, 0))
        return meta

    def _maybe_save(self, meta: HandoffConnectorMetadata, request_id: str, computed_after_step: int) -> None:
        """Once the step computes the prompt's last token, its whole prompt's KV is in the pages: push it."""
        rows = self._prompt[request_id]
        if computed_after_step < rows or rows == 0:
            return
        blocks = self._blocks.pop(request_id)
        self._prompt.pop(request_id)
        meta.saves.append(SaveSpec(request_id, self.handoff_id(request_id), tuple(blocks), rows))
        self._saved[request_id] = rows

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._blocks.pop(request.request_id, None)
        self._prompt.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        rows = self._saved.pop(request.request_id, None)
        if rows is None:
            return False, None
        handoff_id = self.handoff_id(request.request_id)
        model = self.contract.model
        ticket = make_ticket(self.settings.target, model, handoff_id, self.contract.fingerprint)
        return True, {"handoff_id": handoff_id, "position": rows, "model": model, "ticket": ticket}  # pages held
