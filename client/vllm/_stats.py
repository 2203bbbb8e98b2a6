"""What the connector tells vLLM of its transfers: per-interval stats (vLLM logs them as "KV Transfer metrics: ...")
and Prometheus metrics on `vllm serve`'s /metrics, beside the broker's own.

Each worker (each TP rank) records one observation per hand-off it pushed or pulled its part of, or one failure;
vLLM ships the observations from the workers to its logger, where they are summed (`aggregate`), summarised
(`reduce`) and observed into (prometheus_client adds `_total` to a counter's name):

    vllm:handoff_push_seconds            histogram  a push, from the end of the prefill step to the broker's commit
    vllm:handoff_pull_seconds            histogram  a pull, from its start to the last tensor written into the pages
    vllm:handoff_pushed_bytes_total      counter    bytes pushed (the rows the prompts filled)
    vllm:handoff_pulled_bytes_total      counter    bytes pulled
    vllm:handoff_failed_pushes_total     counter    pushes that failed (logged with their reason; the hand-off is
                                                    cancelled, so its decoder recomputes at once)
    vllm:handoff_failed_pulls_total      counter    pulls that failed (their blocks recomputed)
    vllm:handoff_refused_loads_total     counter    hand-offs the consumer refused to load (logged with the reason: a
                                                    prompt digest that is not the request's, ...); vLLM computed the
                                                    prompt
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

SERIES = ("push_seconds", "push_bytes", "pull_seconds", "pull_bytes", "failed_pushes", "failed_pulls", "refused_loads")
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class HandoffConnectorStats(KVConnectorStats):
    """Observations of one interval: a list per series (serialisable: vLLM sends it between processes)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {series: [] for series in SERIES}

    def record_push(self, nbytes: int, seconds: float) -> None:
        self.data["push_bytes"].append(nbytes)
        self.data["push_seconds"].append(seconds)

    def record_pull(self, nbytes: int, seconds: float) -> None:
        self.data["pull_bytes"].append(nbytes)
        self.data["pull_seconds"].append(seconds)

    def record_failure(self, pushing: bool) -> None:
        self.data["failed_pushes" if pushing else "failed_pulls"].append(1)

    def record_refusal(self, reason: str) -> None:
        self.data["refused_loads"].append(reason)

    def aggregate(self, other: KVConnectorStats) -> HandoffConnectorStats:
        for series in SERIES:
            self.data.setdefault(series, []).extend(other.data.get(series, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        summary: dict[str, int | float] = {}
        for kind in ("push", "pull"):
            count, nbytes, seconds = len(d[f"{kind}_bytes"]), sum(d[f"{kind}_bytes"]), sum(d[f"{kind}_seconds"])
            summary[f"{kind}es" if kind == "push" else f"{kind}s"] = count
            summary[f"{kind}ed_MB"] = round(nbytes / 1e6, 3)
            summary[f"{kind}_ms_avg"] = round(1000 * seconds / count, 3) if count else 0
        summary["failed_pushes"] = len(d["failed_pushes"])
        summary["failed_pulls"] = len(d["failed_pulls"])
        summary["refused_loads"] = len(d.get("refused_loads", []))
        return summary

    def is_empty(self) -> bool:
        return not any(self.data.get(series) for series in SERIES)

    def take(self) -> HandoffConnectorStats | None:
        """This interval's observations (None if there were none); the next interval starts empty."""
        if self.is_empty():
            return None
        taken = HandoffConnectorStats(data=self.data)
        self.reset()
        return taken


class HandoffPromMetrics(KVConnectorPromMetrics):
    """The connector's series on vLLM's /metrics, one child per engine (vLLM's own labels)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        def seconds(kind: str, what: str) -> dict[int, Any]:
            return per_engine(self._histogram_cls(name=f"vllm:handoff_{kind}_seconds", documentation=what,
                                                  buckets=SECONDS_BUCKETS, labelnames=labelnames))  # fmt: skip

        def counter(name: str, what: str) -> dict[int, Any]:
            return per_engine(self._counter_cls(name=f"vllm:handoff_{name}", documentation=what, labelnames=labelnames))

        self.push_seconds = seconds("push", "Seconds a hand-off's push took, from the end of its prefill step.")
        self.pull_seconds = seconds("pull", "Seconds a hand-off's pull took, until its KV was in the pages.")
        self.pushed_bytes = counter("pushed_bytes", "Bytes of KV pushed to handoff-broker (the filled rows).")
        self.pulled_bytes = counter("pulled_bytes", "Bytes of KV pulled from handoff-broker.")
        self.failed_pushes = counter("failed_pushes", "Pushes to handoff-broker that failed.")
        self.failed_pulls = counter("failed_pulls", "Pulls from handoff-broker that failed (their blocks recomputed).")
        self.refused_loads = counter("refused_loads", "Hand-offs refused for the request they were passed with "
                                     "(a prompt digest that is not the request's); the prompt was computed.")  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for seconds in d.get("push_seconds", []):
            self.push_seconds[engine_idx].observe(seconds)
        for seconds in d.get("pull_seconds", []):
            self.pull_seconds[engine_idx].observe(seconds)
        self.pushed_bytes[engine_idx].inc(sum(d.get("push_bytes", [])))
        self.pulled_bytes[engine_idx].inc(sum(d.get("pull_bytes", [])))
        self.failed_pushes[engine_idx].inc(len(d.get("failed_pushes", [])))
        self.failed_pulls[engine_idx].inc(len(d.get("failed_pulls", [])))
        self.refused_loads[engine_idx].inc(len(d.get("refused_loads", [])))
