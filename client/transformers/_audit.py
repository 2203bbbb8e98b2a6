"""Audit: a hand-off checked against what a reference engine computes for its prompt, tensor by tensor, without
taking it from its decoder (the broker's audit read: PullRequest.audit, client/_audit_read.py; docs/engines.md).

    report = audit(client, params, model, prompt_ids)     # params: the producer's kv_transfer_params
    report.ok, report.first_bad, report.tensors[i].max_abs / .max_rel / .tolerance, report.notes

The reference is transformers' own cache after the hand-off's `position` tokens, read at the contract's edge by the
same code `prefill` uses (_layout.read_cache), so the comparison is in the contract's logical order whatever engine
produced the hand-off. Each tensor's error is its largest absolute difference, and that relative to the reference
tensor's largest magnitude (a per-element relative error is meaningless where values cross zero). Tolerances depend
on the hand-off's dtype and on which engine produced it, and the report states each one it applied:

    float32, same arithmetic (keys, values, conv rings; recurrent states but Mamba2's from vLLM)       1e-4
    bfloat16 or float16 (any tensor stored so, or computed by a bf16/fp16 model: a bf16 hybrid's
      float32 state, as vLLM's CPU build keeps it, is two engines' bf16 arithmetic apart)            5e-2
    Mamba2 `ssm` from vLLM (`producer="vllm"`): transformers clamps dt from below at time_step_min,
      vLLM 0.32 at 0, so the two engines run another recurrence: float32 2e-2 (1.9e-3 measured on a tiny random
      Nemotron-H; tens of percent in a head with real weights, where tokens still agree): the report says so in
      `notes` rather than crying wolf, and a state past even that is still reported bad

`first_bad` is the first tensor, in contract order, out of its tolerance; `digest_ok` whether the params name this
prompt's hand-off (their digest the prompt's own and ending the id, their position the hand-off's). `ok` needs both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._audit_read import read_handoff
from .._handoff_rules import prompt_digest
from ._layout import kind, read_cache
from ._model import contract_for, run_prompt

SAME_ARITHMETIC = 1e-4
HALF_PRECISION = 5e-2
MAMBA2_DT_CLAMP = 2e-2
DT_CLAMP_NOTE = (
    "Mamba2 state from vLLM: transformers clamps dt from below at time_step_min, vLLM 0.32 at 0, so the engines "
    "compute another recurrence; judged at {tolerance:g}, not {strict:g}"
)


@dataclass(frozen=True)
class TensorAudit:
    """One carried tensor: its largest absolute difference from the reference, that relative to the reference's
    largest magnitude, and the tolerance the relative error is held to."""

    name: str
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.max_rel)) and self.max_rel <= self.tolerance


@dataclass(frozen=True)
class AuditReport:
    """What `audit` found: `ok` when the digest is the prompt's and every tensor is within its tolerance;
    `first_bad` the first tensor (contract order) that is not; every tensor's errors; the notes on tolerances."""

    model: str
    handoff_id: str
    position: int
    producer: str
    digest_ok: bool
    tensors: tuple[TensorAudit, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def first_bad(self) -> str | None:
        return next((t.name for t in self.tensors if not t.ok), None)

    @property
    def ok(self) -> bool:
        return self.digest_ok and self.first_bad is None

    def summary(self) -> str:
        """One line per tensor, then the verdict (what `handoff-broker audit` prints)."""
        lines = [f"{'tensor':40} {'max abs':>12} {'max rel':>12} {'tolerance':>10}  ok"]
        lines += [f"{t.name:40} {t.max_abs:12.3e} {t.max_rel:12.3e} {t.tolerance:10.1e}  {'yes' if t.ok else 'NO'}"
                  for t in self.tensors]  # fmt: skip
        lines += [f"note: {n}" for n in self.notes]
        if not self.digest_ok:
            lines.append("the params' prompt_digest, id or position are not this prompt's hand-off's")
        verdict = "ok" if self.ok else f"BAD: first bad tensor {self.first_bad or '(none: the digest)'}"
        lines.append(
            f"{self.model} hand-off {self.handoff_id} at {self.position} tokens from {self.producer}: {verdict}"
        )
        return "\n".join(lines)


def tolerance(name: str, dtype: str, producer: str, notes: list[str], computed: str = "float32") -> float:
    """The relative tolerance for tensor `name` of `dtype` produced by `producer` from a model computing in
    `computed` (the module's table)."""
    full = dtype in ("float32", "float64") and computed in ("float32", "float64")
    strict = SAME_ARITHMETIC if full else HALF_PRECISION
    if producer == "vllm" and name.endswith(".mamba.ssm"):
        loose = max(strict, MAMBA2_DT_CLAMP)
        note = DT_CLAMP_NOTE.format(tolerance=loose, strict=strict)
        if note not in notes:
            notes.append(note)
        return loose
    return strict


def audit(client: Any, kv_transfer_params: Mapping[str, Any], model: Any, prompt_ids: Sequence[int], *,
          producer: str = "vllm", timeout: float | None = None) -> AuditReport:  # fmt: skip
    """Compare every carried tensor of the hand-off the params name with what `model` computes for `prompt_ids`'
    first `position` tokens, reading it without a claim (its decoder is untouched). `producer`: the engine that
    made it ("vllm", "transformers", or any other name: the strict tolerances), which sets the tolerances."""
    params = dict(kv_transfer_params)
    contract = contract_for(client, model, str(params.get("model", "")))
    handoff = read_handoff(client, contract.model, str(params["handoff_id"]), timeout=timeout)
    position, prompt = handoff.position, list(prompt_ids)
    digest, named = params.get("prompt_digest"), str(params["handoff_id"])
    digest_ok = (
        position <= len(prompt)
        and params.get("position", position) == position
        and (digest is None or (digest == prompt_digest(prompt[:position]) and named.endswith(f"-{digest}")))
    )
    computed = str(model.dtype).removeprefix("torch.")
    reference = read_cache(run_prompt(model, prompt[:position]), contract, position, exact=True)
    notes: list[str] = []
    tensors = []
    for carried in contract.at(position).carried:
        got = np.asarray(handoff.state[carried.name], dtype=np.float32)
        want = reference[carried.name].float().numpy()
        if got.shape != want.shape:  # (a hand-off the broker checked has the contract's shapes: this is the prompt's)
            tensors.append(TensorAudit(carried.name, float("inf"), float("inf"), 0.0))
            continue
        diff = float(np.abs(got - want).max()) if got.size else 0.0
        scale = float(np.abs(want).max()) if want.size else 0.0
        relative = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        tensors.append(
            TensorAudit(carried.name, diff, relative, tolerance(carried.name, carried.dtype, producer, notes, computed))
        )
    return AuditReport(contract.model, str(params["handoff_id"]), position, producer, digest_ok, tuple(tensors),
                       tuple(notes))  # fmt: skip


__all__ = ["AuditReport", "TensorAudit", "audit", "kind"]
