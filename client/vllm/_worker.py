"""The connector's worker half: it moves bytes between vLLM's pages and the broker, in the contract's layout.

At start-up (`register_kv_caches`) it maps each layer to its KV-cache group and kind (_groups.py: attention, a
sliding window's ring, a recurrent state page), learns the page layout of the attention backend vLLM chose
(_layouts.py; an unknown one is refused, by name), an MLA layer's latent pages (_mla_pages.py) or the state page's
(_state_pages.py), and checks that the broker serves this model's contract with the same fingerprint (a broker
serving another contract is refused, naming both fingerprints and what differs: field, tensors, values).

Producer: nothing runs on the forward pass. `wait_for_save`, at the end of the step that computed a prompt's last
token, hands the request to a background sender, which copies each layer's keys and values for the prompt's rows out
of the pages into the contract's layout (after the step's kernels, on a stream of its own on a GPU) and pushes them,
each layer as soon as it is copied, the push taking the copy as tensors still being made (handoff_client._produced):
the broker, and a decoder already pulling, have the first layers while the last are copied (the decoder's pages
1.15-1.5x sooner than copying the whole prompt first, on CPU: docs/performance.md). `push-while-copying: false`
copies the whole prompt first. The copy is made once, by whoever needs it first (_copy_out.py): a step that must have
the pages read before vLLM writes them again (below) makes it itself if no sender has begun it, so it waits for the
copy alone, never for a sender to come free nor for the broker.
The scheduler half holds the request's pages (`request_finished` returns True) until the copy and the push have
ended; then `get_finished` releases them (finished sending), and vLLM, which steps while it holds a finished
request's pages, sees the push's stats at once. A preempted request's pages are freed by vLLM itself, so the next
step has their copy made before its forward pass may write them (`wait_for_copies`, from vLLM's
`handle_preemptions`, which its V1 runner calls before anything writes them; its V2 runner writes reallocated pages
before that call, so there every copy is made within its own step: `reuses_pages_before_preemptions`). A push that
fails is logged with its reason and counted, and the hand-off is cancelled at the broker, every rank's part: a
decoder waiting for it hears at once and recomputes, rather than waiting its timeout for a part that will not come.

Tensor-parallel engines (_tp.py): each rank pushes its own part, `shard=(rank, tp)` (an empty one where it holds
nothing of its own), and pulls `shard=(rank, tp)`; at start-up the KV heads vLLM gives the rank are checked against
the broker's rule. Every rank reports each request in `get_finished` (vLLM counts a request done only once every
rank has), and a rank whose pull fails reports the request as failed, which vLLM unites over the ranks: the
request's prompt is recomputed on every rank, so a load is whole or not at all.

Consumer: `start_load_kv` starts a background pull per request (PULL_THREADS, shared; PROBE_SECONDS); each layer is
written once its key and value have arrived (CPU pages: by vLLM's thread, _cpu_kernels.py). When the pull ends —
confirmed or failed (broker gone, hand-off expired or cancelled, bad checksum, past `timeout`) — `get_transfer_results`
reports the request (finished receiving), a failure also as failed (`failed_recving`), so vLLM recomputes the request's
prompt (or fails the request, by its kv_load_failure_policy). Failures go by request, not by block: block ids are unique
only within a KV-cache group, and vLLM takes block-level errors from no connector of a model with several groups. vLLM
schedules the request only then: its loads are asynchronous, which vLLM does not combine with layer-by-layer loading
(`wait_for_layer_load` has nothing to wait for). Meanwhile vLLM steps without computing anything; in such a step
`get_finished` waits (at most IDLE_WAIT_SECONDS) for a pull to end, so the empty steps do not keep the GIL from the
pull's thread. Each request's push and load is tracked in _transfers.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

import numpy as np
import torch
from handoff_client import HandoffClient, HandoffError
from handoff_client._torch import from_numpy, to_numpy
from handoff_client.protocol.contract import Contract
from handoff_client.protocol.errors import WaitTimedOut
from handoff_client.protocol.shards import Shard

from ._copy_out import CopyOut
from ._cpu_kernels import PageWrites, attention_isa, require_amx
from ._groups import GroupMap, Kind, engine_state_dtype, group_map
from ._layouts import Geometry, PageLayout, layout_for
from ._mla_pages import LatentMover, latent_mover
from ._movers import AttentionMover, StateMover, bound_views, layer_windows, state_mover
from ._pages import cache_writer
from ._scheduler import HandoffConnectorMetadata, LoadSpec, SaveSpec
from ._settings import ConnectorSettings, broker_mismatch
from ._stats import HandoffConnectorStats
from ._tp import check_kv_heads, rank_contracts, tp_shard
from ._transfers import Transfers

logger = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.005
"""How long a step that computes nothing waits for a pull to end: vLLM would step again at once, and its empty steps,
dozens while a pull is under way, take the GIL from the pull's thread (docs/performance.md). Bounded, so a request
arriving meanwhile waits at most this long to be scheduled."""


CANCEL_SECONDS = 5.0
"""The longest a failed push's cancel may take (the sender's thread is busy meanwhile)."""

PULL_THREADS, LATE_PULL_THREADS = 4, 2  # the threads pulling a decode instance's loads: first tries, late ones again
PROBE_SECONDS = 0.2
"""How long a pull holds a thread waiting for its push to begin (`wait_for_push`) before it tries again on a thread of
the late ones, until its `timeout`: late hand-offs never hold a ready one back their whole timeout (four held one 5.97 s
of 6 s), and once probed they wait apart from the loads that come after them (a hundred late ones held one 5 s)."""


def reuses_pages_before_preemptions(vllm_config: Any) -> bool:
    """Whether vLLM's model runner writes pages a step hands out again (zeroing new blocks, prefix-cache copy-on-write)
    before it calls `handle_preemptions`: its V2 runner does (`gpu/model_runner.py` execute_model: update_requests,
    then pre_forward), so there a saved request's copy must end within its own step; V1, which vLLM's CPU build runs,
    calls it first (`gpu_model_runner.py`)."""
    return bool(vllm_config.use_v2_model_runner)


class WorkerHalf:
    """Pushes saved requests and pulls loaded ones, converting between pages and the contract's rows."""

    def __init__(self, settings: ConnectorSettings, contract: Contract, vllm_config: Any, kv_cache_config: Any) -> None:
        self.settings = settings
        self.contract = contract
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.groups: GroupMap | None = None  # each layer's KV-cache group and kind (register_kv_caches)
        # vLLM layer name -> how its pages are moved
        self.movers: dict[str, AttentionMover | StateMover | LatentMover] = {}
        self.client = HandoffClient(settings.target, **settings.client_options())
        self.pages: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, PageLayout] = {}
        self.tensors: dict[str, tuple[str, str]] = {}  # attention layer name -> the contract's (key, value) tensors
        self.layer_of: dict[str, str] = {}  # the contract's tensor name -> its vLLM layer name
        self.shard: Shard | None = None  # this worker's rank and TP size (register_kv_caches)
        self.pushed: frozenset[str] = frozenset()  # the tensors this rank pushes
        self._stream: torch.cuda.Stream | None = None  # pages on a GPU: the stream the background copies run on
        self._senders = ThreadPoolExecutor(4, thread_name_prefix="handoff-push")
        self._sending: set[Future] = set()
        self._receivers = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="handoff-pull")
        self._late_receivers = ThreadPoolExecutor(LATE_PULL_THREADS, thread_name_prefix="handoff-late-pull")
        self.transfers = Transfers()  # each request's push and load
        self.page_writes = PageWrites()  # CPU pages: a load's writes, made on vLLM's own thread (_cpu_kernels.py)
        # whether a saved request's copy is made within its step (wait_for_save) rather than by its push
        self.copy_within_step = False
        self._stats_lock = threading.Lock()
        self.stats = HandoffConnectorStats()

    # -- start-up -----------------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn and verify each layer's pages by its kind (_groups.py): an attention or window layer's backend
        layout, a state layer's conv and recurrent views (checked against the views vLLM's layer bound)."""
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        self.shard = tp_shard()
        self.copy_within_step = reuses_pages_before_preemptions(self.vllm_config)
        check_kv_heads(self.vllm_config, self.contract, self.shard)
        holds, self.pushed = rank_contracts(self.contract, self.shard)
        self.groups = group_map(self.kv_cache_config, holds, layer_windows(self.vllm_config))
        if missing := sorted(set(self.groups.layers) ^ set(kv_caches)):
            raise ValueError(f"{self.contract.model}: vLLM layer `{missing[0]}` is in the KV-cache groups or the pages "
                             "vLLM registered, not both")  # fmt: skip
        backends, isas = set(), set()
        for layer_name, pages in kv_caches.items():
            plan = self.groups.layers[layer_name]
            self.pages[layer_name] = pages
            if pages.is_cuda and self._stream is None:
                self._stream = torch.cuda.Stream(device=pages.device)
            if plan.kind is Kind.STATE:
                self.movers[layer_name] = state_mover(plan, pages, bound_views(self.vllm_config, layer_name))
                continue
            backend = get_current_attn_backends(self.vllm_config, [layer_name])[0].get_name()
            backends.add(backend)
            if plan.kind is Kind.LATENT:  # one latent per token, the same on every TP rank: _mla_pages
                self.movers[layer_name] = latent_mover(plan, backend, pages, self.vllm_config, self.contract.model)
                continue
            key, value = plan.tensors
            geometry = Geometry(key.heads or 1, key.head_dim or key.cols, plan.block_size)
            if pages.dim() == 4 and pages.shape[1] != geometry.kv_heads:  # vLLM 0.32's [blocks, heads, block, C]
                raise ValueError(f"{self.contract.model}: vLLM pages `{layer_name}` with {pages.shape[1]} KV heads at "
                                 f"TP {self.shard}; the contract gives this rank {geometry.kv_heads}")  # fmt: skip
            isas.add(isa := attention_isa(self.vllm_config, layer_name, backend, geometry))
            layout = layout_for(backend, geometry, pages.dtype, isa, pages=pages,
                                writer=cache_writer(self.vllm_config, layer_name))  # fmt: skip
            self.layouts[layer_name] = layout
            self.movers[layer_name] = AttentionMover(plan, layout)
            self.tensors[layer_name] = (key.name, value.name)
        self.layer_of = self.groups.layer_of
        require_amx(isas, self.contract.model)  # (vLLM's AMX kernel: AMX state granted now, or refused by name)
        kinds = sorted({plan.kind.value for plan in self.groups.layers.values()})
        pushing = "sends each layer as it is copied" if self.settings.push_while_copying else "copies every layer first"
        pushing += ", copied within the step (vLLM's V2 model runner)" if self.copy_within_step else ""
        logger.info("handoff connector: %d layers (%s) in %d KV-cache groups, %s pages, TP %s, model %s at %s; "
                    "a push %s", len(kv_caches), ", ".join(kinds), self.groups.groups,
                    ", ".join(sorted(backends)) or "state", self.shard, self.contract.model, self.settings.target,
                    pushing)  # fmt: skip
        self._check_broker_contract()

    def _part(self) -> Shard | None:
        """The shard this rank pushes and pulls; None at TP 1 (the whole hand-off)."""
        return None if self.shard is None or self.shard.whole else self.shard

    def _check_broker_contract(self) -> None:
        served = self.client.get_contract(self.contract.model)
        if served.fingerprint != self.contract.fingerprint:  # names both, what differs, and the broker's flags
            raise broker_mismatch(served, self.contract, engine_state_dtype(self.kv_cache_config))

    @contextlib.contextmanager
    def _on_own_stream(self, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """GPU pages: run the block's copies on the connector's stream (after `after`) and wait for them at its end."""
        if self._stream is None:
            yield
            return
        try:
            with torch.cuda.stream(self._stream):
                if after is not None:
                    self._stream.wait_event(after)
                yield
        finally:  # also when the block fails: no copy of a failed load may land after vLLM recomputes the blocks
            self._stream.synchronize()

    # -- producer -----------------------------------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, metadata: HandoffConnectorMetadata) -> None:
        return  # nothing on the forward pass: the pages are read after the step, by the background sender

    def wait_for_save(self, metadata: HandoffConnectorMetadata) -> None:
        if not metadata.saves:
            return
        written = self._step_event()  # the step's kernels may still be writing the pages: copy after them
        for save in metadata.saves:
            copy = CopyOut(self._copied_out(save, written))
            if not self.transfers.push_saved(save.request_id, copy):
                logger.warning("hand-off %s: request %s is saved again while its first push is under way; the first "
                               "push is kept and this save dropped", save.handoff_id, save.request_id)  # fmt: skip
                continue
            if self.copy_within_step:  # vLLM's V2 runner may write freed pages before handle_preemptions: copy now
                copy.ensure()
            try:
                sending = self._senders.submit(self._push_and_end, save, copy)
            except BaseException:
                self.transfers.push_ended(save.request_id)
                raise
            self._sending.add(sending)
            sending.add_done_callback(self._sending.discard)

    def _push_and_end(self, save: SaveSpec, copy: CopyOut) -> None:
        pushed = False
        try:
            pushed = self._push(save, copy)
        finally:
            self.transfers.push_ended(save.request_id)  # (its pages may go once copied: before any cancel below)
        if not pushed:
            self._give_up(save)

    def _push(self, save: SaveSpec, copy: CopyOut) -> bool:
        """Push the request's copy; whether it was pushed (a failure is logged and counted)."""
        started = time.perf_counter()
        try:
            placed = {"broker": save.broker} if save.broker else {}  # (a fleet: where the ticket says it goes)
            tensors = copy.tensors()
            if not self.settings.push_while_copying:  # the whole copy first (the module's docstring)
                tensors = dict(tensors)
            result = self.client.push(self.contract.model, save.handoff_id, save.rows, tensors,
                                      ttl=self.settings.ttl or None, shard=self._part(), **placed)  # fmt: skip
        except HandoffError as e:
            logger.warning("hand-off %s was not pushed: %s %s", save.handoff_id, e.reason, e.message)
            return False
        except Exception:  # a worker thread must not die silently; the pages are released all the same
            logger.exception("hand-off %s was not pushed", save.handoff_id)
            return False
        with self._stats_lock:
            self.stats.record_push(result.bytes, time.perf_counter() - started)
        return True

    def _give_up(self, save: SaveSpec) -> None:
        """A push that failed: counted, and the hand-off cancelled at the broker (every rank's part, and a tombstone
        where nothing of it arrived; in a fleet, at the broker the push was placed on), so the decoder's pull fails
        at once and vLLM recomputes the prompt there. Best effort, and bounded: a broker that cannot be reached has
        nothing a decoder could pull either. (A push whose commit went through but whose answer was lost is
        cancelled too: its decoder recomputes, which is never wrong.)"""
        self._record_failure(pushing=True)
        placed = {"broker": save.broker} if save.broker else {}
        try:
            timeout = min(self.settings.timeout, CANCEL_SECONDS)
            self.client.cancel(self.contract.model, save.handoff_id, timeout=timeout, **placed)
        except HandoffError as e:
            logger.debug("hand-off %s not cancelled after its failed push: %s %s", save.handoff_id, e.reason, e.message)

    def _copied_out(self, save: SaveSpec, written: torch.cuda.Event | None) -> Iterator[tuple[str, np.ndarray]]:
        """This rank's part of every layer's tensors after the prompt's rows, copied out of the pages layer by layer
        in the contract's layout (its heads' columns; at TP 1 the whole: attention rows, a window's ring, a state
        block), each yielded as soon as its layer is copied (run once, by its push or by a step: _copy_out.py)."""
        for layer_name, mover in self.movers.items():
            plan = mover.plan
            if not any(t.name in self.pushed for t in plan.tensors):
                continue  # its heads are pushed by a lower rank holding them too
            with self._on_own_stream(after=written):
                gathered = mover.gather(self.pages[layer_name], save.block_ids[plan.group], save.rows)
                arrays = [(name, to_numpy(tensor.cpu())) for name, tensor in gathered.items() if name in self.pushed]
            yield from arrays

    def _record_failure(self, pushing: bool) -> None:
        with self._stats_lock:
            self.stats.record_failure(pushing)

    def wait_for_copies(self, metadata: HandoffConnectorMetadata) -> None:
        """Before a step's forward pass may write pages vLLM freed, wait for the copies still reading them: a
        preempted request's (vLLM frees its pages, pushed or not), or with sliding windows every copy (vLLM frees a
        window's passed blocks after each step). Called by vLLM before the forward (`handle_preemptions`); never
        from `start_load_kv`, which vLLM calls after the forward when a step's loads are asynchronous, as all of
        this connector's are."""
        windows = self.groups is not None and self.groups.has_windows
        for copy in self.transfers.copies(None if windows else metadata.preempted):
            copy.ensure()  # (made here if no sender has begun it: never waits for a sender or the broker)

    # -- consumer -----------------------------------------------------------------------------------------------------

    def start_load_kv(self, metadata: HandoffConnectorMetadata) -> None:
        self.transfers.loads_started(len(metadata.loads))
        deadline = time.monotonic() + self.settings.timeout
        zeroed = self._step_event()  # GPU: vLLM zeroed the fresh pages in this step: the loads write after that
        for load in metadata.loads:
            self._receivers.submit(self._pull, load, deadline, time.perf_counter(), zeroed)

    def _step_event(self) -> torch.cuda.Event | None:
        """GPU pages: an event after the step's kernels so far, for the connector's stream to wait on (CPU: None)."""
        return torch.cuda.current_stream(self._stream.device).record_event() if self._stream is not None else None

    def _pull(self, load: LoadSpec, deadline: float, started: float, zeroed: torch.cuda.Event | None) -> None:
        """Pull `load`'s hand-off into its pages by `deadline` (monotonic): a push not begun within PROBE_SECONDS
        lets the thread go, the pull queued again behind the late loads."""
        arrived: dict[str, np.ndarray] = {}
        try:
            remaining = max(deadline - time.monotonic(), 0.001)
            pulled = self.client.pull_tensors(self.contract.model, load.handoff_id, timeout=remaining,
                                              wait_for_push=min(PROBE_SECONDS, remaining), shard=self._part(),
                                              ticket=load.ticket)  # fmt: skip
            with self._on_own_stream(after=zeroed), contextlib.closing(iter(pulled)) as arriving:
                for carried, array in arriving:
                    if pulled.position != load.rows:  # (known from the header, before any tensor is written)
                        raise ValueError(f"the hand-off is at position {pulled.position}, the request's load expects "
                                         f"{load.rows} tokens: refused, not loaded short or long")  # fmt: skip
                    arrived[carried.name] = array
                    self._write_layer(load, self.layer_of[carried.name], arrived)
            if pulled.position != load.rows:  # (a pull that brought this rank no tensor at all)
                raise ValueError(f"the hand-off is at position {pulled.position}, the request's load expects "
                                 f"{load.rows} tokens: refused")  # fmt: skip
            nbytes = sum(a.nbytes for a in arrived.values())
        except WaitTimedOut:  # (before any tensor came: nothing written)
            if deadline - time.monotonic() < PROBE_SECONDS or not self._pull_again(load, deadline, started, zeroed):
                self._load_failed(load, f"no push of it began within the timeout of {self.settings.timeout:g} s")
            return
        except Exception as e:  # noqa: BLE001 - any failure at all: vLLM recomputes the blocks
            return self._load_failed(load, f"{e.reason} {e.message}" if isinstance(e, HandoffError) else repr(e))
        with self._stats_lock:
            self.stats.record_pull(nbytes, time.perf_counter() - started)
        self.transfers.load_ended(load.request_id, failed=False)

    def _pull_again(self, load: LoadSpec, *when: Any) -> bool:
        """Queue `load`'s pull again, behind the late loads alone; False once the pool is shut down."""
        with contextlib.suppress(RuntimeError):  # (shutting down)
            return self._late_receivers.submit(self._pull, load, *when) is not None
        return False

    def _load_failed(self, load: LoadSpec, why: str) -> None:
        logger.warning("hand-off %s was not loaded (%s): vLLM recomputes its blocks", load.handoff_id, why)
        self._record_failure(pushing=False)
        self.transfers.load_ended(load.request_id, failed=True)

    def _write_layer(self, load: LoadSpec, layer_name: str, arrived: dict[str, np.ndarray]) -> None:
        """Write the layer into the request's pages once all its tensors have arrived (each tensor arrives once, so
        a layer is written once: when the last of its tensors does)."""
        mover = self.movers[layer_name]
        names = [t.name for t in mover.plan.tensors]
        if all(name in arrived for name in names):
            tensors = {name: from_numpy(arrived[name]) for name in names}
            write = partial(mover.scatter, self.pages[layer_name], load.block_ids[mover.plan.group], load.first,
                            load.rows, tensors)  # fmt: skip
            if self._stream is None:  # CPU pages: written on vLLM's own thread, before the load is reported
                self.page_writes.add(load.request_id, write)
            else:
                write()

    # -- both ---------------------------------------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str], idle: bool = False) -> tuple[set[str], set[str], set[str]]:
        """(requests whose pages the producer releases now, requests whose load ended, those of them whose load
        failed), each reported once; vLLM's finished requests are remembered until their push has ended. `idle`: the
        step computed nothing (its requests all wait for their loads): wait up to IDLE_WAIT_SECONDS for a pull to
        end, rather than have vLLM step again at once."""
        if idle:
            self.transfers.wait_for_a_load(IDLE_WAIT_SECONDS)
        if self.transfers.loading or self._sending:
            # vLLM steps in a tight loop while a transfer is under way: let our threads have the GIL now, not at the
            # next 5 ms switch (pulls 3x sooner: vllm_engines.py)
            time.sleep(0)
        released = self.transfers.release(finished_req_ids)
        received, failed = self.page_writes.settle(*self.transfers.take_ended_loads())  # (CPU pages written first)
        return released, received, failed

    def take_stats(self) -> HandoffConnectorStats | None:
        with self._stats_lock:
            return self.stats.take()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every push handed to the background sender to end; whether all did."""
        _, pending = wait(list(self._sending), timeout=timeout)
        return not pending

    def shutdown(self) -> None:
        self._senders.shutdown(wait=True)
        self._receivers.shutdown(wait=True)
        self._late_receivers.shutdown(wait=True)
        self.client.close()
