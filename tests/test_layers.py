"""The package's layers, read from its source: no import circles and no import against the layer order.

Every import counts, the ones inside functions too (an import moved into a function hides a circle from
Python, not from this test). The order, from the top: the entry modules (`transformer/__init__.py`,
`transformer/train.py`, `transformer/__main__.py`) -> cli/ -> training/ -> inference/ -> data/ and the core
(the modules at the top). A module may import its own layer and the layers below it. Nothing under cli/
loads torch when it is imported: its module-level imports, followed through the package, reach no module
that imports torch at module level (`--help` and a refused argument answer before torch loads).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "transformer"
ENTRY_MODULES = ("", ".train", ".__main__")  # after the package's name: __init__.py, train.py, __main__.py
LAYERS = {"cli": 4, "training": 3, "inference": 2, "data": 1}  # the core: 1, the entry modules: 5


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str, root: str = "transformer") -> int:
    if module in {root + entry for entry in ENTRY_MODULES}:
        return 5
    parts = module.split(".")
    return LAYERS.get(parts[1], 1) if len(parts) > 2 else 1


def is_module_level(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """An import run when its module is imported: not inside a function nor under `if TYPE_CHECKING:`
    (if/try/with at the top count)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return False
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return False
    return True


def import_graph(package: Path) -> tuple[dict[str, set[str]], dict[str, set[str]], set[str]]:
    """(every import, module-level imports, the modules that import torch at module level), by module."""
    root = package.name
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    every: dict[str, set[str]] = {m: set() for m in modules}
    top: dict[str, set[str]] = {m: set() for m in modules}
    torch_at_top: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in modules:  # `from a.b import c` names a module c or a name in a.b
            name = name.rpartition(".")[0]
        return name or None

    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    anchor = module.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            at_top = is_module_level(node, parents)
            for name in names:
                if name == "torch" or name.startswith("torch."):
                    if at_top:
                        torch_at_top.add(module)
                    continue
                if name != root and not name.startswith(root + "."):
                    continue
                target = resolve(name)
                if target and target != module:
                    every[module].add(target)
                    if at_top:
                        top[module].add(target)
    return every, top, torch_at_top


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def against_the_order(graph: dict[str, set[str]], root: str = "transformer") -> list[str]:
    return sorted(
        f"{a} (layer {layer(a, root)}) imports {b} (layer {layer(b, root)})"
        for a, targets in graph.items()
        for b in targets
        if layer(b, root) > layer(a, root)
    )


def torch_on_import(top: dict[str, set[str]], torch_at_top: set[str], module: str) -> list[str]:
    """The chain of module-level imports from `module` to one that imports torch, or []."""
    seen, queue = {module: [module]}, [module]
    while queue:
        current = queue.pop(0)
        if current in torch_at_top:
            return seen[current]
        for nxt in sorted(top.get(current, ())):
            if nxt not in seen:
                seen[nxt] = seen[current] + [nxt]
                queue.append(nxt)
    return []


GRAPH, TOP, TORCH_AT_TOP = import_graph(PACKAGE)


def test_the_graph_is_read_from_the_source():
    # Teeth for the readers below: known edges of the real package are found, function-level ones included.
    assert "transformer.model" in GRAPH["transformer.checkpoint"]
    assert "transformer.model" in TORCH_AT_TOP
    assert any(GRAPH[m] - TOP[m] for m in GRAPH), "no import inside a function was seen"


def test_no_import_circles():
    assert circles(GRAPH) == []


def test_no_import_against_the_layer_order():
    assert against_the_order(GRAPH) == []


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if layer(m) == 4))
def test_no_command_module_loads_torch_when_imported(module):
    assert torch_on_import(TOP, TORCH_AT_TOP, module) == []


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "transformer"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [package, *[p for p in package.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    return package


def test_the_checks_catch_a_circle_a_layer_breach_and_torch_under_cli(tmp_path):
    package = _fake_package(
        tmp_path,
        {
            "model.py": "import torch\n",
            "data/corpus.py": "def f():\n    from transformer.data import mixture\n",  # hidden in a function
            "data/mixture.py": "from transformer.data.corpus import f\n",
            "inference/search.py": "from . import helpers\n",
            "inference/helpers.py": "def g():\n    from transformer.training import trainer\n",
            "training/trainer.py": "from transformer import model\n",
            "cli/translate.py": "from typing import TYPE_CHECKING\nfrom transformer.training.trainer import x\n"
            "if TYPE_CHECKING:\n    from transformer.inference import search\n",
        },
    )
    graph, top, torch_at_top = import_graph(package)
    assert circles(graph) == [["transformer.data.corpus", "transformer.data.mixture"]]
    assert against_the_order(graph) == [
        "transformer.inference.helpers (layer 2) imports transformer.training.trainer (layer 3)"
    ]
    assert torch_on_import(top, torch_at_top, "transformer.cli.translate") == [
        "transformer.cli.translate",
        "transformer.training.trainer",
        "transformer.model",
    ]
