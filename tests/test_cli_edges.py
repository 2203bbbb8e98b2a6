"""The command line's edges: every value out of its range is one line naming the flag, the variable or the config
key, never a traceback and never a silent wrap-around; and the small promises around them (a version, a default
port, a pipe closed early, help for every option)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from certs import Authority
from conftest import MANIFESTS
from handoff_broker.cli import build_parser, main

COMMAND = [sys.executable, "-m", "handoff_broker"]
VERSION = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]["version"]


def refusal(capsys, *argv: str) -> str:
    """What the command prints when it refuses `argv` (exit status 2, no traceback)."""
    try:
        status = main(list(argv))
    except SystemExit as e:  # argparse's refusals
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--port", "70000"), ("--port", "-5"), ("--metrics-port", "70000"), ("--metrics-port", "-2"),
     ("--lane-port", "70000"), ("--lane-port", "-1"), ("--port", "http")],
)  # fmt: skip
def test_a_port_outside_0_to_65535_is_refused_naming_the_flag(capsys, flag, value):
    """Fails before the fix: --port 70000 listened on 4464, --port -5 on 65531, the others ended in OverflowError."""
    err = refusal(capsys, "serve", flag, value)
    assert f"argument {flag}: `{value}` is not a port: 0..65535" in err


@pytest.mark.parametrize("value", ["0", "-2", "65536", "x"])
def test_health_asks_a_port_it_can_connect_to_or_the_main_one(capsys, value):
    """Fails before the fix: `health --health-port 0` was accepted and asked port 0 (serve's 0, any free port, is
    no port to ask)."""
    err = refusal(capsys, "health", "--health-port", value)
    assert f"argument --health-port: `{value}` is not a port to ask: 1..65535, or -1 for the main port" in err
    assert [build_parser().parse_args(["health", "--health-port", v]).health_port for v in ("1", "-1")] == [1, -1]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--ttl", "-5"), ("--ttl", "nan"), ("--ttl", "inf"), ("--ttl", "0"), ("--grace", "-1"), ("--idle-timeout", "-3"),
     ("--lease", "0"), ("--push-deadline", "0"), ("--resume-window", "-1"), ("--trim-after", "nan"),
     ("--keepalive", "0"), ("--keepalive-timeout", "-1"), ("--ttl", "1e12")],
)  # fmt: skip
def test_every_duration_is_finite_and_at_least_its_floor(capsys, flag, value):
    """Fails before the fix: each of these was accepted (--ttl nan, --lease 0: a broker that expires everything)."""
    err = refusal(capsys, "serve", flag, value)
    assert f"argument {flag}: `{value}` is not a duration: a finite number of seconds" in err


def test_durations_that_may_be_zero_are_zero_or_more(capsys):
    args = build_parser().parse_args(["serve", "--grace", "0", "--resume-window", "0", "--trim-after", "0"])
    assert (args.grace, args.resume_window, args.trim_after) == (0.0, 0.0, 0.0)
    assert "above 0" in refusal(capsys, "serve", "--ttl", "0") and "0 or more" in refusal(
        capsys, "serve", "--grace", "-1"
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["serve", "--workers", "0"], "argument --workers: `0` is not a number of worker threads in 2..10000"),
     (["serve", "--etcd-lease", "0"], "argument --etcd-lease: `0` is not a number of seconds in 1.."),
     (["serve", "--max-streams-per-connection", "0"], "argument --max-streams-per-connection: `0` is not"),
     (["status", "--timeout", "-1"], "argument --timeout: `-1` is not a duration"),
     (["health", "--timeout", "nan"], "argument --timeout: `nan` is not a duration"),
     (["traffic", "prefill", "--interval", "-1"], "argument --interval: `-1` is not a duration"),
     (["contract-from-config", "x.json", "--ctx", "0"], "argument --ctx: `0` is not a cache length"),
     (["demo", "--position", "-1"], "argument --position: `-1` is not a number of tokens")],
)  # fmt: skip
def test_counts_and_the_client_commands_durations_are_bounded_too(capsys, argv, says):
    """Fails before the fix: --workers 0 was a ValueError traceback from deep in the broker's start."""
    assert says in refusal(capsys, *argv)


def test_a_demo_position_past_the_cache_or_an_unknown_model_is_one_line(capsys):
    """Fails before the fix: the push worker failed, then the demo waited out its decoder's 60 s timeout."""
    assert "demo: --position 4096: demo-hybrid holds positions 0..4095" in refusal(capsys, "demo", "--position", "4096")
    assert "demo: --model llama: the demo serves demo-hybrid" in refusal(capsys, "demo", "--model", "llama")


def test_the_environment_is_checked_as_the_flag_is_and_named(capsys, monkeypatch):
    monkeypatch.setenv("HANDOFF_TTL", "-5")
    assert "HANDOFF_TTL='-5' is not a valid --ttl: `-5` is not a duration" in refusal(capsys, "serve")
    monkeypatch.setenv("HANDOFF_TTL", "5")
    monkeypatch.setenv("HANDOFF_METRICS_PORT", "70000")
    assert "HANDOFF_METRICS_PORT='70000' is not a valid --metrics-port" in refusal(capsys, "serve")


def test_a_repeatable_flag_from_the_environment_is_a_list_of_one(monkeypatch):
    """Fails before the fix: HANDOFF_MODEL_CONFIG=x.json became the string "x.json", read character by character."""
    monkeypatch.setenv("HANDOFF_MODEL_CONFIG", "llama=config.json")
    assert build_parser().parse_args(["serve"]).model_config == ["llama=config.json"]


def test_a_config_file_value_is_checked_as_the_flag_is_and_named_by_its_key(capsys, tmp_path: Path):
    """Fails before the fix: `ttl = "five"` was a ValueError traceback, and `ttl = -5` was accepted."""
    config = tmp_path / "broker.toml"
    for line, says in (
        ('ttl = "five"', "ttl = 'five': `five` is not a duration"),
        ("ttl = -5", "ttl = -5: `-5` is not a duration"),
        ("port = 70000", "port = 70000: `70000` is not a port"),
        ("workers = 0", "workers = 0: `0` is not a number of worker threads"),
        ("no-lanes = 1", "no-lanes = 1: a switch: true or false"),
        ("host = 5", None),  # a string flag takes the number as text
        ("ttl = [1]", "ttl = [1]: a string or a number"),
    ):
        config.write_text(line + "\n")
        if says is None:
            continue
        assert f"{config}: {says}" in refusal(capsys, "serve", "--config", str(config))
    config.write_text('ttl = 12.5\nno-lanes = true\nmax-bytes = "1GiB"\nmetrics-port = -1\n')
    parser = build_parser()
    from handoff_broker.flag_sources import apply_config_file

    apply_config_file(parser, ["serve", "--config", str(config)])
    args = parser.parse_args(["serve", "--config", str(config)])
    assert (args.ttl, args.lanes, args.max_bytes, args.metrics_port) == (12.5, False, 1 << 30, -1)


def test_the_log_level_from_the_environment_may_be_any_case():
    """Fails before the fix: HANDOFF_LOG_LEVEL=debug raised ValueError: Unknown level: 'debug'. (A process of its
    own: logging is configured once per process.)"""

    def check(level: str, *before: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "HANDOFF_LOG_LEVEL": level} if level else os.environ
        return subprocess.run([*COMMAND, *before, "check-contracts", str(MANIFESTS)], env=env, check=False, capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    assert check("debug").returncode == 0, check("debug").stderr
    chatty = check("chatty")
    assert chatty.returncode == 2 and "HANDOFF_LOG_LEVEL='chatty' is not a valid --log-level" in chatty.stderr
    assert check("", "--log-level", "warning").returncode == 0


def test_a_garbage_tls_certificate_or_key_is_named_with_its_file(capsys, tmp_path: Path):
    """Fails before the fix: each ended in gRPC's `Failed to bind to address 127.0.0.1:0`."""
    authority = Authority("edges-ca")
    files = {}
    for name, data in (
        ("garbage", b"not a certificate\n"),
        ("cert", (server := authority.issue("localhost", server=True)).cert),
        ("key", server.key),
        ("other-key", authority.issue("c", server=False).key),
    ):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(data)
    serve = ("serve", "--port", "0", "--metrics-port", "-1")
    err = refusal(capsys, *serve, "--tls-cert", str(files["garbage"]), "--tls-key", str(files["key"]))
    assert f"cannot start: --tls-cert {files['garbage']}: no PEM certificate in it" in err
    err = refusal(capsys, *serve, "--tls-cert", str(files["cert"]), "--tls-key", str(files["garbage"]))
    assert f"cannot start: --tls-key {files['garbage']}: not an unencrypted PEM private key" in err
    err = refusal(capsys, *serve, "--tls-cert", str(files["cert"]), "--tls-key", str(files["other-key"]))
    assert f"--tls-key {files['other-key']}: this key is not the key of the certificate in --tls-cert" in err
    err = refusal(capsys, *serve, "--tls-cert", str(files["cert"]), "--tls-key", str(files["key"]),
                  "--tls-client-ca", str(files["garbage"]))  # fmt: skip
    assert f"cannot start: --tls-client-ca {files['garbage']}: no PEM certificate in it" in err


def test_a_taken_grpc_port_is_named_with_the_reason(capsys):
    """Fails before the fix: `Failed to bind to address 127.0.0.1:PORT; set GRPC_VERBOSITY=debug ...`."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = refusal(capsys, "serve", "--port", str(port), "--metrics-port", "-1")
    assert f"cannot listen for gRPC (--port) on 127.0.0.1:{port}: Address already in use" in err
    assert "Failed to bind" not in err


def test_a_target_without_a_port_dials_50051(monkeypatch):
    """Fails before the fix: `--target 127.0.0.1` dialled 443. A broker on 50051 itself (if free) answers."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 50051)) == 0:
            pytest.skip("something already listens on 127.0.0.1:50051")
    from handoff_broker import BrokerConfig, build_server

    broker, _ = build_server(BrokerConfig(port=50051, lanes=False))
    broker.start()
    try:
        done = subprocess.run([*COMMAND, "health", "--target", "127.0.0.1", "--timeout", "5"], check=False, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert (done.returncode, done.stdout.strip()) == (0, "127.0.0.1: SERVING"), done.stderr
    finally:
        broker.stop(0)


def test_version_on_the_command_line_and_in_the_client():
    import handoff_client

    done = subprocess.run([*COMMAND, "--version"], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert done.stdout.startswith(f"handoff-broker {handoff_client.__version__} (Python ")
    assert handoff_client.__version__ == VERSION  # the installed package's metadata, as pyproject states it


def test_every_command_says_what_it_does_and_every_option_has_help():
    """Fails before the fix: the commands had no description, and --target, --model, --timeout... no help."""
    subcommands = build_parser()._subparsers._group_actions[0]
    for name, command in subcommands.choices.items():
        assert command.description, name
        for action in command._actions:
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings or action.dest}"


def test_environment_names_never_stutter_nor_mean_two_things():
    """Fails before the fix: demo's --handoff-id read HANDOFF_HANDOFF_ID, and HANDOFF_MODEL was the --model of
    demo, traffic and contract-from-config alike."""
    subcommands = build_parser()._subparsers._group_actions[0]
    meaning: dict[str, set[str]] = {}
    for command in subcommands.choices.values():
        for action in command._actions:
            variable = (action.help or "").partition("[env ")[2].rstrip("]")
            if variable:
                assert not variable.startswith("HANDOFF_HANDOFF"), variable
                meaning.setdefault(variable, set()).add(action.dest)
    assert all(len(dests) == 1 for dests in meaning.values()), meaning
    assert "HANDOFF_MODEL" not in meaning and "HANDOFF_TARGET" in meaning


def test_status_into_a_pipe_closed_early_ends_quietly(broker):
    """Fails before the fix: `status | head` printed `[Errno 32] Broken pipe` and an ignored exception."""
    status = subprocess.Popen([*COMMAND, "status", "--target", broker.address], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    status.stdout.close()  # the reader is gone before the first line
    err = status.stderr.read()
    assert status.wait(timeout=60) == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err


def test_a_max_bytes_too_small_for_a_hand_off_starts_with_a_warning():
    broker = subprocess.Popen([*COMMAND, "serve", "--port", "0", "--metrics-port", "-1", "--max-bytes", "100",
                               "--no-lanes", "--grace", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert "listening on" in broker.stdout.readline()
    finally:
        broker.terminate()
        broker.wait(timeout=60)
    err = broker.stderr.read()
    assert "--max-bytes 100 (100 B) holds no hand-off of demo-hybrid even after 1000 tokens" in err


def test_status_says_what_a_hand_off_at_a_typical_position_holds(broker, contracts):
    done = subprocess.run([*COMMAND, "status", "--target", broker.address], check=False, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    demo = contracts["demo-hybrid"]
    assert (f"contract demo-hybrid: ctx {demo.ctx}, {len(demo.carried)} tensors, {demo.nbytes} bytes a hand-off at "
            f"the full ctx, {demo.at(1000).nbytes} after 1000 tokens") in done.stdout  # fmt: skip


def test_the_server_extra_hint_works_from_a_clone_and_from_git():
    from handoff_broker.cli import INSTALL_SERVER

    assert "pip install '.[server]'" in INSTALL_SERVER and "@ git+https://" in INSTALL_SERVER
    assert "pip install 'handoff-broker[server]'" not in INSTALL_SERVER  # on no index: that line cannot work


def closed_port() -> int:
    """A port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_etcd_is_checked_like_every_flag_and_before_anything_listens(capsys):
    """Fails before the fix: `--etcd nonsense` and an etcd not answering were a bare `<urlopen error ...>`, printed
    after the lanes had started."""
    err = refusal(capsys, "serve", "--etcd", "nonsense")
    assert "argument --etcd: `nonsense` is not an etcd address: etcd://host:port/prefix" in err
    url = f"etcd://127.0.0.1:{closed_port()}/fleet"
    err = refusal(capsys, "serve", "--port", "0", "--metrics-port", "-1", "--etcd", url)
    assert f"cannot start: --etcd {url}: etcd does not answer at http://127.0.0.1:" in err
    assert "(Connection refused)" in err and "urlopen" not in err


def test_a_host_this_machine_cannot_listen_on_blames_host(capsys):
    """Fails before the fix: `--host 999.1.1.1` said `cannot listen for the TCP lane (--lane-port)`."""
    err = refusal(capsys, "serve", "--port", "0", "--metrics-port", "-1", "--host", "999.1.1.1")
    assert "cannot start: --host 999.1.1.1: not an address or host name this machine can resolve" in err
    assert "--lane-port" not in err
    err = refusal(capsys, "serve", "--port", "0", "--metrics-port", "-1", "--host", "192.0.2.7")  # (TEST-NET-1)
    assert "cannot start: --host 192.0.2.7: not an address of this machine: cannot listen on it" in err


def test_a_missing_tls_or_token_file_names_its_flag(capsys, tmp_path: Path):
    """Fails before the fix: `[Errno 2] No such file or directory: '/...'`, no flag."""
    gone = str(tmp_path / "gone.pem")
    err = refusal(capsys, "serve", "--port", "0", "--metrics-port", "-1", "--tls-cert", gone, "--tls-key", gone)
    assert f"cannot start: --tls-cert {gone}: No such file or directory" in err
    for flag in ("--tls-ca", "--token-file"):
        err = refusal(capsys, "status", "--target", f"127.0.0.1:{closed_port()}", flag, gone)
        assert f"handoff-broker status: {flag} {gone}: No such file or directory" in err


def test_the_config_file_takes_log_level_and_log_format_below_the_environment(capsys, tmp_path: Path):
    """Fails before the fix: `log-level: not a serve flag`, though --help and docs/configuration.md say every serve
    flag may go in the file. (Processes of their own: logging is configured once per process.)"""
    config = tmp_path / "broker.toml"

    def serve(lines: str, **env: str) -> subprocess.CompletedProcess:  # a warning logged, then a refusal: no listening
        config.write_text(lines + '\nmax-bytes = "1KiB"\nhost = "999.1.1.1"\nmetrics-port = -1\n')
        return subprocess.run([*COMMAND, "serve", "--config", str(config)], env={**os.environ, **env}, check=False,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    done = serve('log-level = "warning"\nlog-format = "json"')
    assert done.returncode == 2 and '"level": "WARNING"' in done.stderr and "holds no hand-off" in done.stderr
    assert "holds no hand-off" not in serve('log-level = "error"').stderr
    assert '"level"' not in serve('log-format = "json"', HANDOFF_LOG_FORMAT="text").stderr  # the environment wins
    config.write_text('log-level = "chatty"\n')
    refused = refusal(capsys, "serve", "--config", str(config))
    assert f"{config}: log-level = 'chatty': `chatty` is not a log level" in refused
