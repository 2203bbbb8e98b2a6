"""What the connector is told (`kv_connector_extra_config`) and the contract it derives from the served model.

Keys are the command line's flag names where they overlap (`handoff-broker status --target ... --tls-ca ...`):

    target       the broker, or a fleet ("host1:50051,host2:50051", "dns:///brokers:50051")  default 127.0.0.1:50051
    model        the contract's name on the broker                              default: the served model's name
    tls-ca       PEM file of the CA to trust (TLS)
    tls-cert     PEM file of this client's certificate (mutual TLS), with tls-key
    tls-key      PEM file of its private key
    token-file   a file holding the bearer token
    timeout      seconds a push or a pull may take, end to end                 default 30
    ttl          seconds a pushed hand-off waits for its decoder (0: the broker's --ttl)
    push-while-copying   true: push each layer as soon as it is copied out of the pages; false: copy the whole
                 prompt first, then push (docs/performance.md)                  default true
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handoff_client.protocol.contract import MODEL_NAME, Contract, differences
from handoff_client.protocol.errors import FingerprintMismatch

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 30.0
MAX_SECONDS = 86400.0
"""The longest `timeout` or `ttl` a setting may give: a day."""

CACHE_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}
"""vLLM's cache dtypes the connector carries, by the torch dtype "auto" resolves to."""

KNOWN_KEYS = {"target", "model", "tls-ca", "tls-cert", "tls-key", "token-file", "timeout", "ttl", "push-while-copying"}
SWITCH = {True: True, False: False, "true": True, "false": False}
"""push-while-copying's values (JSON booleans or strings)."""


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings, read once from `kv_connector_extra_config`."""

    target: str = DEFAULT_TARGET
    model: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    ttl: float = 0.0
    push_while_copying: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        if unknown := sorted(set(extra) - KNOWN_KEYS):
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
                f"the handoff connector takes {', '.join(sorted(KNOWN_KEYS))}"
            )
        switch = extra.get("push-while-copying", True)
        if not isinstance(switch, (bool, str)) or switch not in SWITCH:
            raise ValueError(f"kv_connector_extra_config: push-while-copying is {switch!r}; it takes true or false")
        return cls(
            push_while_copying=SWITCH[switch],
            target=str(extra.get("target", DEFAULT_TARGET)),
            model=extra.get("model"),
            tls_ca=extra.get("tls-ca"),
            tls_cert=extra.get("tls-cert"),
            tls_key=extra.get("tls-key"),
            token_file=extra.get("token-file"),
            timeout=_seconds(extra, "timeout", DEFAULT_TIMEOUT, zero=False),
            ttl=_seconds(extra, "ttl", 0.0, zero=True),
        )

    def client_options(self) -> dict[str, Any]:
        """HandoffClient's keyword arguments for these settings."""

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        token = Path(self.token_file).read_text().strip() if self.token_file else None
        return {
            "timeout": self.timeout,
            "token": token,
            "tls_root_certificates": read(self.tls_ca),
            "tls_certificate_chain": read(self.tls_cert),
            "tls_private_key": read(self.tls_key),
        }


def _seconds(extra: dict[str, Any], key: str, default: float, *, zero: bool) -> float:
    """A setting in seconds: a finite number, above 0 (or 0 itself where `zero`), at most MAX_SECONDS."""
    value = extra.get(key, default)
    try:
        seconds = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (0 <= seconds <= MAX_SECONDS) or (seconds == 0 and not zero):
        least = "0 or more" if zero else "more than 0"
        raise ValueError(f"kv_connector_extra_config: {key} is {value!r}; it takes seconds, {least}, at most "
                         f"{MAX_SECONDS:g}")  # fmt: skip
    return seconds


def served_contract(vllm_config: Any, settings: ConnectorSettings, state_dtype: str | None = None) -> Contract:
    """The contract of the model vLLM serves, derived from its config.json exactly as `handoff-broker
    contract-from-config` and `serve --model-config` derive it: over vLLM's max_model_len, in its cache dtype, and
    recurrent states (hybrids) in `state_dtype`, the dtype vLLM resolved for them (_groups.engine_state_dtype)."""
    from handoff_client._architectures import DEFAULT_STATE_DTYPE, contract_from_config

    model_config = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    resolved = str(model_config.dtype) if cache_dtype == "auto" else f"torch.{cache_dtype}"
    if resolved not in CACHE_DTYPES:
        raise ValueError(
            f"the handoff connector carries caches of {', '.join(v for v in CACHE_DTYPES.values())}, "
            f"not kv_cache_dtype {cache_dtype} ({resolved})"
        )
    name = settings.model or model_config.served_model_name
    if isinstance(name, list):
        name = name[0]
    if not MODEL_NAME.fullmatch(name):  # vLLM names a model its path when served_model_name is not given
        raise ValueError(
            f"the handoff connector names its contract after the served model, and {name!r} is not a contract model "
            "name (a letter or digit, then up to 127 of letters, digits and ._:/@+-): set kv_connector_extra_config's "
            "`model` (or vLLM's served_model_name) to the model name the broker's contract has"
        )
    return contract_from_config(
        model_config.hf_config.to_dict(),
        ctx=model_config.max_model_len,
        dtype=CACHE_DTYPES[resolved],
        model=name,
        state_dtype=state_dtype or DEFAULT_STATE_DTYPE,
    )


def broker_mismatch(served: Contract, engine: Contract, state_dtype: str | None) -> FingerprintMismatch:
    """The broker serves another contract for the model than the one this engine derives (`served_contract`): the
    error names what differs (protocol.contract.differences: field, tensors, both values) and the broker flags that
    serve the engine's contract, its recurrent-state dtype (`state_dtype`) the one vLLM allocates, which on CPUs
    with AVX-512 BF16 vLLM's CPU build makes float32 for `auto` (docs/vllm.md#cpus)."""
    flags = [f"--config-ctx {engine.ctx}"]
    flags += [f"--config-dtype {c.dtype}" for c in engine.carried if c.rows_are_positions][:1]
    flags += [f"--config-state-dtype {state_dtype}"] if state_dtype else []
    advice = (
        f"serve this engine's contract at the broker (`handoff-broker serve --model-config {engine.model}=DIR "
        f"{' '.join(flags)}`, or contract-from-config the same), or start vLLM so that it derives the broker's"
    )
    if state_dtype:
        advice += (
            f"; vLLM allocates this engine's recurrent state in {state_dtype} (its mamba_ssm_cache_dtype as resolved: "
            "`auto` on a CPU with AVX-512 BF16 gives float32; docs/vllm.md#cpus)"
        )
    found = differences(served, engine, ("broker", "engine"))
    return FingerprintMismatch(engine.model, served.fingerprint, engine.fingerprint, found, advice)
