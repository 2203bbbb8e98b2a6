"""The connector's scheduler half: it only decides and builds metadata; the worker half moves the bytes.

The router contract is vLLM's P/D convention, the one NIXL-style routers already drive (docs/vllm.md):

Producer (`kv_producer`, `kv_both`): only a request whose `kv_transfer_params` carry `"do_remote_decode": true` is
handed off; every other request runs untouched and nothing of it is pushed. Once such a request's prompt is fully
computed in a step, its save entry (blocks, prompt length) goes into that step's metadata; after the step the worker
copies the prompt's rows out of the pages and pushes them in the background. `request_finished` holds a saved
request's pages (returns True) until the worker reports the push ended, and hands the router `kv_transfer_params` =
{do_remote_prefill: true, do_remote_decode: false, handoff_id, position, model, ticket, prompt_digest}; the ticket
names, as `e`, the broker's incarnation as last learned (_incarnations.py), so that a decoder whose broker restarted
since is told so at once (BrokerRestarted) and recomputes. A 1-token prompt has nothing to hand over (the decoder
computes its last token itself): nothing is pushed. Under a contract that cannot be rewound (recurrent state, a
sliding window's ring) a handed-off request's last prompt token is dropped before it is scheduled and the hand-off
is at N - 1 (the last-token rule, _last_token.py); block ids are kept per KV-cache group (_groups.py). Each step's
metadata also names the requests vLLM preempted in it, whose pages it freed: the worker lets no copy still read them
once the next forward pass may write them. A request is saved once: resumed after a preemption it comes back among
the cached requests (`resumed_req_ids`, vLLM's V1 model runner) or among the new ones (its V2 runner, and vLLM 0.34
always), and either way its hand-off already holds its prompt. The hand-off id is `handoff_id_for`'s, within the
broker's 256 characters whatever the client's request id.

Consumer (`kv_consumer`, `kv_both`): a request whose `kv_transfer_params` carry a `handoff_id` (and do not set
`do_remote_prefill` false) has its first `position` prompt tokens loaded asynchronously (vLLM then computes only the
last prompt token); the load entry names the request's freshly allocated blocks, and the worker pulls the hand-off
straight into them. The right KV for the right prompt: `prompt_digest` (a digest of the prompt's first `position`
token ids and of what else makes their KV differ: multimodal items, LoRA adapter, cache salt; `request_digest`; also
the hand-off id's last part) must equal the digest of the request's own, else nothing is
loaded and vLLM computes the prompt itself; the refusal is logged with its reason and counted
(`vllm:handoff_refused_loads`). Params without a digest (today's routers) load as before. So is, by the last-token
rule, a hand-off of all N prompt tokens under a contract that cannot be rewound.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from handoff_client._handoff_rules import handoff_id, params_refusal, transfer_params
from handoff_client.fleet import FleetClient, is_fleet, make_ticket
from handoff_client.protocol.contract import Contract
from handoff_client.protocol.errors import HandoffError
from handoff_client.protocol.prompts import prompt_digest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ._groups import BlockIds, GroupMap, extend, per_group
from ._incarnations import Incarnations
from ._last_token import stops_short, truncate
from ._settings import ConnectorSettings
from ._stats import HandoffConnectorStats

logger = logging.getLogger(__name__)


def request_digest(request: Any, position: int) -> str:
    """The prompt digest (handoff_client.protocol.prompts.prompt_digest, the one every engine computes) of vLLM
    request `request`'s first `position` prompt tokens, covering what vLLM's own prefix cache keys on besides them:
    its multimodal items (`mm_features`: content hash and placeholder), its LoRA adapter's name, its `cache_salt`."""
    features = getattr(request, "mm_features", None) or ()
    lora = getattr(request, "lora_request", None)
    return prompt_digest(
        (request.prompt_token_ids or [])[:position],
        multimodal=[(f.identifier, f.mm_position.offset, f.mm_position.length) for f in features],
        adapter=lora.lora_name if lora is not None else None,
        cache_salt=getattr(request, "cache_salt", None),
    )


def handoff_id_for(engine_id: str, request_id: str, digest: str) -> str:
    """`{engine_id}-{request_id}-{digest}`: the engine id makes an engine's own request ids (an offline run numbers
    them from 0) unique, and the digest ends it, so an id names one prompt's KV; past what the broker takes, hashed
    (`_handoff_rules.handoff_id`, every adapter's rule)."""
    return handoff_id(f"{engine_id}-{request_id}", digest)


def _truthy(params: dict[str, Any], key: str) -> bool:
    return params.get(key) is True or params.get(key) in ("true", "True", 1)


@dataclass(frozen=True)
class SaveSpec:
    """Push request `request_id`'s first `rows` tokens (its whole prompt) from `block_ids` (one tuple per KV-cache
    group) as `handoff_id`, to `broker` (a fleet target: the broker its ticket names; "": the target)."""

    request_id: str
    handoff_id: str
    block_ids: BlockIds
    rows: int
    broker: str = ""


@dataclass(frozen=True)
class LoadSpec:
    """Pull `handoff_id` (a hand-off after `rows` tokens) into `block_ids` (one tuple per KV-cache group), writing
    tokens [first, rows); from the broker `ticket` names, if given."""

    request_id: str
    handoff_id: str
    block_ids: BlockIds
    first: int
    rows: int
    ticket: str | None = None


@dataclass
class HandoffConnectorMetadata(KVConnectorMetadata):
    """What one step's worker halves must do: the saves and loads the scheduler half decided, and the requests
    vLLM preempted (their pages freed) in this step."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    idle: bool = False
    """The step computes nothing: every request it has waits for its load (or it has none)."""


class SchedulerHalf:
    """Decides which requests are pushed (producer) or pulled (consumer); builds each step's metadata."""

    def __init__(self, settings: ConnectorSettings, contract: Contract, groups: GroupMap, engine_id: str,
                 producer: bool, consumer: bool, hash_block_size: int | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.contract = contract
        self.groups = groups
        self.engine_id = engine_id
        self.producer = producer
        self.consumer = consumer
        self.hash_block_size = hash_block_size  # vLLM 0.34's KVCacheConfig.hash_block_size (None before)
        self._wanted: dict[str, str] = {}  # producer: request to hand off -> its prompt's digest
        self._blocks: dict[str, BlockIds] = {}  # producer: each unsaved request's blocks so far, per group
        self._prompt: dict[str, int] = {}
        self._saved: dict[str, int] = {}  # producer: request -> rows pushed
        self._placed: dict[str, str] = {}  # producer: request -> the fleet broker its push goes to, its ticket names
        # A fleet target: each push is placed here, before its ticket is handed out (the worker pushes there alone).
        self._fleet = FleetClient(settings.target) if is_fleet(settings.target) else None
        # Producer: each broker's incarnation, which its tickets name, learned from start-up on (the set's brokers
        # then).
        self._incarnations = Incarnations(settings, contract.model) if producer else None
        if self._incarnations is not None:
            try:
                for broker in self._fleet.brokers() if self._fleet is not None else [settings.target]:
                    self._incarnations.of(broker)
            except HandoffError as e:  # (the set cannot be read now: each broker is learned once a ticket names it)
                logger.info("the brokers' incarnations are not learned at start-up: %s", e.message)
        self._loads: dict[str, LoadSpec] = {}
        self._loaded: set[str] = set()
        self._refused: set[str] = set()  # consumer: requests whose hand-off was refused (logged and counted once)
        self._local_hits: dict[str, int] = {}  # consumer: tokens vLLM's own prefix cache holds, as it told us
        self._warned_no_digest = False  # consumer: params without a prompt_digest were warned of (once)
        self.stats = HandoffConnectorStats()

    def shutdown(self) -> None:
        """Close the fleet client that places pushes, if any (its channels and its membership's watch), and the
        incarnations' thread and channels."""
        if self._fleet is not None:
            self._fleet.close()
        if self._incarnations is not None:
            self._incarnations.close()

    def handoff_id(self, request_id: str) -> str:
        """The hand-off id of a request to hand off (`handoff_id_for`)."""
        return handoff_id_for(self.engine_id, request_id, self._wanted[request_id])

    def on_new_request(self, request: Any) -> None:
        """Producer: remember a request the router asked to hand off (`do_remote_decode`), with its prompt's digest."""
        params = request.kv_transfer_params or {}
        if not self.producer or not _truthy(params, "do_remote_decode"):
            return
        tokens = request.prompt_token_ids or []
        if len(tokens) < 2:
            logger.debug("request %s: a prompt of %d token(s) has nothing to hand over (the decoder computes its "
                         "last token itself); nothing is pushed", request.request_id, len(tokens))  # fmt: skip
            return
        if stops_short(self.contract) and (why := truncate(request, self.hash_block_size)) is not None:
            logger.info("request %s is not handed off: %s cannot stop one token short (the last-token rule of a "
                        "contract that cannot be rewound)", request.request_id, why)  # fmt: skip
            return
        self._wanted[request.request_id] = request_digest(request, len(request.prompt_token_ids))

    def take_stats(self) -> HandoffConnectorStats | None:
        return self.stats.take()

    # -- consumer -----------------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not self.consumer or "handoff_id" not in params or params.get("do_remote_prefill", True) is False:
            return 0, False
        if request.request_id in self._loaded or request.request_id in self._refused:
            return 0, False
        why = self._refusal(request, params)
        if why is not None:
            self._refused.add(request.request_id)
            self.stats.record_refusal(why)
            logger.warning("hand-off %s was not loaded into request %s: %s; vLLM computes the prompt itself",
                           params.get("handoff_id"), request.request_id, why)  # fmt: skip
            return 0, False
        rows = min(int(params["position"]), request.num_prompt_tokens)
        count = rows - num_computed_tokens
        if count <= 0:
            return 0, False
        # vLLM calls update_state_after_alloc before it sets request.num_computed_tokens, so the local prefix-cache
        # hit it passes here is the only record of where the load starts.
        self._local_hits[request.request_id] = num_computed_tokens
        return count, True

    def may_load_async(self, request: Any) -> bool:
        """Whether `get_num_new_matched_tokens` may answer an asynchronous load for `request` (vLLM 0.34 asks as the
        request enters a waiting queue: cheap, its params and one set alone; a request it then refuses is a false
        positive, which only holds back other loads a while; one already refused or loaded is never one)."""
        params = request.kv_transfer_params or {}
        return (self.consumer and "handoff_id" in params and params.get("do_remote_prefill", True) is not False
                and request.request_id not in self._loaded
                and request.request_id not in self._refused)  # fmt: skip

    def _refusal(self, request: Any, params: dict[str, Any]) -> str | None:
        """Why the hand-off named in `params` must not be loaded into `request` (None: it may): the checks every
        consumer makes (handoff_client._handoff_rules.params_refusal), with vLLM's request digest."""
        if params.get("prompt_digest") is None and not self._warned_no_digest:  # earlier routers' fields: said once
            self._warned_no_digest = True
            logger.warning("hand-off %s came without a prompt_digest: loaded without checking it is this request's "
                           "prompt (a router that keeps every kv_transfer_params field passes it on); said once",
                           params.get("handoff_id"))  # fmt: skip
        return params_refusal(self.contract, params, request.num_prompt_tokens, lambda n: request_digest(request, n))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or request.request_id in self._loaded:
            return
        params = request.kv_transfer_params
        ticket = params.get("ticket")
        # The load starts after the local prefix-cache hit (which is not overwritten): vLLM has not yet set
        # request.num_computed_tokens to it when it calls this hook (scheduler.py), so it is the count that
        # get_num_new_matched_tokens was given.
        first = self._local_hits.pop(request.request_id, 0)
        self._loads[request.request_id] = LoadSpec(
            request.request_id, str(params["handoff_id"]), per_group(blocks.get_block_ids(), self.groups.groups), first,
            first + num_external_tokens, ticket if isinstance(ticket, str) else None,
        )  # fmt: skip
        self._loaded.add(request.request_id)

    # -- producer -----------------------------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> HandoffConnectorMetadata:
        meta = HandoffConnectorMetadata(loads=list(self._loads.values()))
        meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        self._loads.clear()
        if not self.producer:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._wanted or new.req_id in self._saved:
                # not to be handed off (it runs untouched), or saved already: a request resumed after a preemption
                # comes among the new ones under vLLM's V2 model runner, and on vLLM 0.34 always; its hand-off
                # holds its prompt, pushed once
                continue
            self._blocks[new.req_id] = per_group(new.block_ids, self.groups.groups)
            self._prompt[new.req_id] = len(new.prompt_token_ids or [])
            self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if request_id not in self._blocks:
                continue
            if request_id in getattr(cached, "resumed_req_ids", ()):
                # resumed after a preemption: its blocks were freed and these are all of its blocks now. (vLLM 0.34
                # has no such field: it sends every resumed request among the new ones, with its whole block table;
                # tests/test_vllm_next.py checks that of each release _compat admits.)
                self._blocks[request_id] = per_group(cached.new_block_ids[i] or (), self.groups.groups)
            else:
                self._blocks[request_id] = extend(self._blocks[request_id], cached.new_block_ids[i])
            self._maybe_save(meta, request_id, cached.num_computed_tokens[i] + scheduled.get(request_id, 0))
        return meta

    def _maybe_save(self, meta: HandoffConnectorMetadata, request_id: str, computed_after_step: int) -> None:
        """Once the step computes the prompt's last token, its whole prompt's KV is in the pages: push it."""
        rows = self._prompt[request_id]
        if computed_after_step < rows or rows == 0:
            return
        blocks = self._blocks.pop(request_id)
        self._prompt.pop(request_id)
        handoff_id = self.handoff_id(request_id)
        try:
            broker = self._fleet.place(self.contract.model, handoff_id) if self._fleet is not None else ""
        except HandoffError as e:  # (no broker in the set, or the set cannot be read)
            logger.warning("hand-off %s is not pushed: %s", handoff_id, e.message)
            return
        meta.saves.append(SaveSpec(request_id, handoff_id, blocks, rows, broker))
        self._saved[request_id] = rows
        self._placed[request_id] = broker

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Hold a pushed request's pages (every group's) until its push ends; the params the router passes on."""
        self._blocks.pop(request.request_id, None)
        self._prompt.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        self._refused.discard(request.request_id)
        self._local_hits.pop(request.request_id, None)
        rows = self._saved.pop(request.request_id, None)
        broker = self._placed.pop(request.request_id, "")
        if rows is None:
            self._wanted.pop(request.request_id, None)
            return False, None
        handoff_id = self.handoff_id(request.request_id)
        digest = self._wanted.pop(request.request_id)
        model = self.contract.model
        broker = broker or self.settings.target
        incarnation = self._incarnations.of(broker) if self._incarnations is not None else ""
        ticket = make_ticket(broker, model, handoff_id, self.contract.fingerprint, incarnation, before_push=True)
        return True, transfer_params(handoff_id, rows, model, ticket, digest)  # pages held
