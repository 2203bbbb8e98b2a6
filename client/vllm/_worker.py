"""The connector's worker half: it moves bytes between vLLM's pages and the broker, in the contract's layout.

At start-up (`register_kv_caches`) it learns the page layout of the attention backend vLLM chose (_layouts.py;
an unknown one is refused, by name) and checks that the broker serves this model's contract with the same
fingerprint (a broker serving another contract is refused, naming both fingerprints).

Producer: `save_kv_layer` gathers each layer's keys and values for the prompt's rows out of the pages as the
forward pass writes them (a copy in logical order); `wait_for_save` hands each finished request to a background
sender, so the network never stalls the forward pass. A push that fails is logged with its reason; nothing waits.

Consumer: `start_load_kv` starts a background pull per request; each tensor is written into the request's pages as
it arrives whole. When the pull ends — confirmed, or failed (broker gone, hand-off expired or cancelled, a checksum
or digest failed, past `timeout`) — `get_finished` reports the request, and a failure's blocks are reported by
`get_block_ids_with_load_errors`, so vLLM recomputes them (or fails the request, by its kv_load_failure_policy).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
from handoff_client import HandoffClient, HandoffError
from handoff_client._contract import Contract
from handoff_client._errors import FingerprintMismatch
from handoff_client._torch import from_numpy, to_numpy

from ._layouts import Geometry, PageLayout, layout_for
from ._scheduler import HandoffConnectorMetadata, LoadSpec, SaveSpec
from ._settings import ConnectorSettings

logger = logging.getLogger(__name__)

LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class WorkerHalf:
    """Pushes saved requests and pulls loaded ones, converting between pages and the contract's rows."""

    def __init__(self, settings: ConnectorSettings, contract: Contract, vllm_config: Any) -> None:
        self.settings = settings
        self.contract = contract
        self.vllm_config = vllm_config
        self.client = HandoffClient(settings.target, **settings.client_options())
        self.pages: dict[str, Any] = {}
        self.layouts: dict[str, PageLayout] = {}
        self.tensors: dict[str, tuple[str, str]] = {}  # vLLM layer name -> the contract's (key, value) tensors
        self.layer_of: dict[str, str] = {}  # the contract's tensor name -> its vLLM layer name
        self._gathered: dict[str, dict[str, np.ndarray]] = {}
        self._senders = ThreadPoolExecutor(4, thread_name_prefix="handoff-push")
        self._sending: set[Future] = set()
        self._receivers = ThreadPoolExecutor(4, thread_name_prefix="handoff-pull")
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = {"pushed_bytes": 0, "push_seconds": 0.0, "pulled_bytes": 0, "pull_seconds": 0.0,
                      "gather_seconds": 0.0}  # fmt: skip

    # -- start-up -----------------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backend = get_current_attn_backends(self.vllm_config)[0].get_name()
        cache = self.vllm_config.cache_config
        for layer_name, pages in kv_caches.items():
            index = LAYER_INDEX.search(layer_name)
            if index is None:
                raise ValueError(f"vLLM layer `{layer_name}` names no layer index the contract can match")
            keys = [c for c in self.contract.of_layer(int(index.group(1))) if c.name.endswith("k_cache")]
            values = [c for c in self.contract.of_layer(int(index.group(1))) if c.name.endswith("v_cache")]
            if len(keys) != 1 or len(values) != 1:
                raise ValueError(f"{self.contract.model}: layer {index.group(1)} has no key and value cache to carry")
            geometry = Geometry(keys[0].heads or 1, keys[0].head_dim or keys[0].cols, cache.block_size)
            self.layouts[layer_name] = layout_for(backend, geometry, pages.dtype, self._isa(backend, geometry))
            self.pages[layer_name] = pages
            self.tensors[layer_name] = (keys[0].name, values[0].name)
            self.layer_of.update({keys[0].name: layer_name, values[0].name: layer_name})
        logger.info("handoff connector: %d layers, %s pages, block %d, model %s at %s", len(kv_caches),
                    backend, cache.block_size, self.contract.model, self.settings.target)  # fmt: skip
        self._check_broker_contract()

    def _isa(self, backend: str, geometry: Geometry) -> str | None:
        if backend != "CPU_ATTN":
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = self.vllm_config.model_config
        return _get_attn_isa(model.dtype, geometry.block, geometry.head_dim, self.vllm_config.cache_config.cache_dtype)

    def _check_broker_contract(self) -> None:
        served = self.client.get_contract(self.contract.model)
        if served.fingerprint != self.contract.fingerprint:
            raise FingerprintMismatch(
                self.contract.model, served.fingerprint, self.contract.fingerprint
            )  # names both: the broker's, and the one this engine's model and cache dtype make

    # -- producer -----------------------------------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, metadata: HandoffConnectorMetadata) -> None:
        if not metadata.saves or layer_name not in self.layouts:
            return
        started = time.perf_counter()
        key_name, value_name = self.tensors[layer_name]
        for save in metadata.saves:
            keys, values = self.layouts[layer_name].gather(self.pages[layer_name], list(save.block_ids), save.rows)
            gathered = self._gathered.setdefault(save.request_id, {})
            gathered[key_name] = to_numpy(keys.cpu())
            gathered[value_name] = to_numpy(values.cpu())
        self.stats["gather_seconds"] += time.perf_counter() - started

    def wait_for_save(self, metadata: HandoffConnectorMetadata) -> None:
        for save in metadata.saves:
            tensors = self._gathered.pop(save.request_id, {})
            if len(tensors) == len(self.contract.carried):
                sending = self._senders.submit(self._push, save, tensors)
                self._sending.add(sending)
                sending.add_done_callback(self._sending.discard)
            else:
                logger.warning("hand-off %s: %d of %d tensors gathered; not pushed", save.handoff_id,
                               len(tensors), len(self.contract.carried))  # fmt: skip

    def _push(self, save: SaveSpec, tensors: dict[str, np.ndarray]) -> None:
        started = time.perf_counter()
        try:
            result = self.client.push(self.contract.model, save.handoff_id, save.rows, tensors,
                                      ttl=self.settings.ttl or None)  # fmt: skip
        except HandoffError as e:
            logger.warning("hand-off %s was not pushed: %s %s", save.handoff_id, e.reason, e.message)
            return
        except Exception:  # a worker thread must not die silently
            logger.exception("hand-off %s was not pushed", save.handoff_id)
            return
        with self._lock:
            self.stats["pushed_bytes"] += result.bytes
            self.stats["push_seconds"] += time.perf_counter() - started

    # -- consumer -----------------------------------------------------------------------------------------------------

    def start_load_kv(self, metadata: HandoffConnectorMetadata) -> None:
        for load in metadata.loads:
            self._receivers.submit(self._pull, load)

    def _pull(self, load: LoadSpec) -> None:
        started = time.perf_counter()
        arrived: dict[str, np.ndarray] = {}
        try:
            pulled = self.client.pull_tensors(self.contract.model, load.handoff_id, timeout=self.settings.timeout)
            for carried, array in pulled:
                arrived[carried.name] = array
                self._write_layer(load, self.layer_of[carried.name], arrived)
            nbytes = sum(a.nbytes for a in arrived.values())
        except Exception as e:  # noqa: BLE001 - any failure at all: vLLM recomputes the blocks
            why = f"{e.reason} {e.message}" if isinstance(e, HandoffError) else repr(e)
            logger.warning("hand-off %s was not loaded (%s): vLLM recomputes its blocks", load.handoff_id, why)
            with self._lock:
                self._load_errors.update(load.block_ids[load.first // self._block_size() :])
                self._received.add(load.request_id)
            return
        with self._lock:
            self.stats["pulled_bytes"] += nbytes
            self.stats["pull_seconds"] += time.perf_counter() - started
            self._received.add(load.request_id)

    def _block_size(self) -> int:
        return self.vllm_config.cache_config.block_size

    def _write_layer(self, load: LoadSpec, layer_name: str, arrived: dict[str, np.ndarray]) -> None:
        """Write the layer into the request's pages once both its key and its value have arrived (each tensor
        arrives once, so a layer is written once: when the second of its two does)."""
        key_name, value_name = self.tensors[layer_name]
        if key_name in arrived and value_name in arrived:
            keys = from_numpy(arrived[key_name][load.first : load.rows])
            values = from_numpy(arrived[value_name][load.first : load.rows])
            if self.settings.corrupt_pulled_kv:
                keys = keys.flip(0)
            pages = self.pages[layer_name]
            self.layouts[layer_name].scatter(pages, list(load.block_ids), load.first, keys.to(pages.device),
                                             values.to(pages.device))  # fmt: skip

    def get_finished(self) -> set[str]:
        with self._lock:
            done, self._received = self._received, set()
        return done

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every push handed to the background sender to end; whether all did."""
        _, pending = wait(list(self._sending), timeout=timeout)
        return not pending

    def shutdown(self) -> None:
        self._senders.shutdown(wait=True)
        self._receivers.shutdown(wait=True)
        self.client.close()
