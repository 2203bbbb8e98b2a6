"""`serve --model-config` and `contract-from-config` through the real CLI: a model directory is read as vLLM reads
it (DIR/config.json), and a config.json that carries no name of its own (a real Hugging Face one has no
`_name_or_path`) is refused without NAME=, in one line, however the flag is given (command line, env, TOML)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from handoff_client import HandoffClient
from test_cli import COMMAND, CONFIGS, start_serving


def refused(*argv: str, env: dict[str, str] | None = None) -> str:
    """What the real CLI prints on stderr when it refuses `argv`: exit status 2, nothing on stdout, no traceback. A
    broker that starts instead is stopped, and the test fails."""
    run = subprocess.Popen([*COMMAND, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **(env or {})})  # fmt: skip
    try:
        out, err = run.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        run.kill()
        out, err = run.communicate()
    assert (run.returncode, out) == (2, ""), f"not refused: {out}{err}"
    assert "Traceback" not in err
    return err


def hub_config(folder: Path, source: str = "llama-3-8b.json") -> Path:
    """A model directory as the Hugging Face cache holds it: its config.json without `_name_or_path`."""
    config = json.loads((CONFIGS / source).read_text())
    del config["_name_or_path"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_model_directory_is_read_as_vllm_reads_it_and_served_under_its_name(tmp_path: Path):
    """Fails before the fix: a directory was read as a file, `not a readable config.json: Is a directory`."""
    model = hub_config(tmp_path / "Llama-3-8B")
    broker, address = start_serving("--model-config", f"meta-llama/Meta-Llama-3-8B={model}", "--config-ctx", "64")
    try:
        with HandoffClient(address) as client:
            (contract,) = client.list_contracts()
            assert (contract.model, contract.ctx, len(contract.carried)) == ("meta-llama/Meta-Llama-3-8B", 64, 64)
    finally:
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(timeout=15) == 0


@pytest.mark.parametrize("as_directory", [False, True])
def test_a_config_without_a_name_is_refused_without_name_in_one_line(tmp_path: Path, as_directory: bool):
    """Fails before the fix: the contract was silently named `llama`, which vLLM does not serve, and a second Llama
    config collided with it."""
    given = hub_config(tmp_path / "m")
    given = given if as_directory else given / "config.json"
    assert refused("serve", "--port", "0", "--metrics-port", "-1", "--model-config", str(given)) == (
        f"handoff-broker: cannot start: --model-config {given}: name the model as vLLM serves it: "
        f"--model-config NAME={given} (NAME as --served-model-name)\n"
    )
    assert refused("contract-from-config", str(given)) == (
        f"handoff-broker: contract-from-config {given}: name the model as vLLM serves it: --model NAME "
        "(NAME as --served-model-name)\n"
    )


def test_the_environment_and_the_toml_file_are_checked_as_the_flag_is(tmp_path: Path):
    config = hub_config(tmp_path / "m") / "config.json"
    serve = ("serve", "--port", "0", "--metrics-port", "-1")
    says = f"--model-config {config}: name the model as vLLM serves it"
    assert says in refused(*serve, env={"HANDOFF_MODEL_CONFIG": str(config)})
    settings = tmp_path / "broker.toml"
    settings.write_text(f"model-config = [{json.dumps(str(config))}]\n")
    assert says in refused(*serve, "--config", str(settings))
