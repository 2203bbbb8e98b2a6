"""The code's shape, as the robustness issue required: the broker's modules import one another without a cycle, and
so do the client's (lazy imports inside functions count; imports only for type checkers do not); the fleet depends on
the one-broker client, never the reverse (type checkers' imports count there too); and as the project asks of all its
code, no module of the broker or the client is past 400 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "server"
CLIENT = ROOT / "client"
MAX_LINES = 400
FLEET = "handoff_client.fleet"
ABOVE_THE_FLEET = {"handoff_client", "handoff_client._handoff"}
"""The modules outside handoff_client.fleet that may import it: the package's names and HandoffClient(target), which
makes a FleetClient for a fleet target (the vLLM connector, an adapter above both, is not checked here)."""


def _modules(package: str, folder: Path) -> dict[str, Path]:
    """Every module of the package in `folder`, subpackages included, by its dotted name."""
    found = {}
    for path in folder.rglob("*.py"):
        parts = [package, *path.relative_to(folder).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path], typing: bool = False) -> set[str]:
    """The modules of `modules` that module `name` imports at run time (relative or absolute, anywhere but under
    TYPE_CHECKING unless `typing`; `from . import x` names module x)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def known(module: str) -> str | None:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        return module or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING" and not typing:
            return
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else known(module))
        elif isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found - {None, name}


def test_the_broker_modules_import_one_another_without_a_cycle():
    """Every module of handoff_broker, its store package's included."""
    modules = _modules("handoff_broker", SERVER)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "handoff_broker.store.intake" in graph["handoff_broker.store.store"]  # (the graph sees the subpackage)
    _assert_acyclic(graph)


def test_the_client_modules_import_one_another_without_a_cycle():
    """Every module of handoff_client, its protocol, fleet and vllm packages' included."""
    modules = _modules("handoff_client", CLIENT)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "handoff_client.vllm._pages" in graph["handoff_client.vllm._layouts"]  # (the graph sees the subpackage)
    _assert_acyclic(graph)


def test_the_fleet_uses_the_one_broker_client_and_nothing_of_that_client_uses_the_fleet():
    """handoff_client.fleet imports the one-broker client (_client.py); no module of the one-broker client or of
    protocol/ imports the fleet, not even for type checking, so the folder shows which way the layers point."""
    modules = _modules("handoff_client", CLIENT)
    graph = {name: _imports(name, path, modules, typing=True) for name, path in modules.items()}
    assert "handoff_client._client" in graph["handoff_client.fleet._client"]
    reaching = sorted(
        name for name, imported in graph.items()
        if any(i == FLEET or i.startswith(FLEET + ".") for i in imported)
        and not name.startswith((FLEET, "handoff_client.vllm")) and name not in ABOVE_THE_FLEET
    )  # fmt: skip
    assert reaching == []


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    """No module of `graph` (module -> the modules it imports) imports itself through others; the message names a
    cycle."""
    state: dict[str, str] = {}

    def walk(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            assert state.get(imported) != "open", "import cycle: " + " -> ".join([*path, imported])
            if imported not in state:
                walk(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])


def test_no_module_of_the_broker_or_the_client_is_past_400_lines():
    written = [
        p for p in [*SERVER.rglob("*.py"), *CLIENT.rglob("*.py")] if "messages" not in p.parts
    ]  # (not generated)
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in written}
    assert len(sizes) > 40
    assert {path: lines for path, lines in sizes.items() if lines > MAX_LINES} == {}


def test_the_broker_imports_nothing_private_of_the_client():
    """The broker shares the client's public protocol package (handoff_client.protocol), never its private modules:
    "private" means private."""
    private = re.compile(r"handoff_client\._[a-z]")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in SERVER.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if private.search(line) and not line.lstrip().startswith("#")]  # fmt: skip
    assert found == []
