"""The package's layers, read from its imports: data flows traces -> graphs -> models ->
training / serving / mitigation / evaluation, and no module imports from a layer above it. What
fault injection and mitigation both do to a cluster (`cluster`) sits below both.

Every `import bmeg...` counts, at module level or inside a function (an import moved into a
function to dodge a circle is still a dependency); only imports under `if TYPE_CHECKING:` are
left out, since they never run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bmeg"

#: subpackage (or top-level module) -> the ones it may import. Leaves first.
ALLOWED: dict[str, set[str]] = {
    "version": set(),
    "paths": set(),
    "diagnosis": set(),
    "traces": {"paths"},
    "graphs": {"traces", "paths"},
    "cluster": {"paths"},
    "faultinject": {"traces", "graphs", "cluster", "paths"},
    "datasets": {"traces", "graphs", "faultinject", "paths"},
    "models": {"traces", "graphs", "diagnosis", "paths", "version"},
    "training": {"traces", "graphs", "faultinject", "datasets", "models", "diagnosis", "paths"},
    "evaluation": {"traces", "graphs", "faultinject", "datasets", "models", "training", "diagnosis", "paths"},
    "mitigation": {"traces", "graphs", "cluster", "faultinject", "models", "diagnosis", "paths"},
    # the server and the consumer attach the planner's hints to diagnoses; mitigation never
    # imports serving
    "serving": {"traces", "graphs", "models", "mitigation", "diagnosis", "paths", "version"},
    # the facade (`bmeg.diagnose`) and the command line sit on top
    "__init__": {"version", "models", "mitigation", "diagnosis", "traces"},
    "cli": {"*"},
    "__main__": {"cli"},  # `python -m bmeg` (as torchrun starts it) is the command line
}

def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module) -> list[str]:
    """Absolute `bmeg...` imports that can run (not under `if TYPE_CHECKING:`)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("bmeg"):
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names if alias.name.startswith("bmeg"))
    return found


def _module_graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target in _runtime_imports(ast.parse(path.read_text())):
            # a package's __init__ importing its own submodules is how packages are built; not the
            # top-level one: `bmeg.diagnose` (the facade) has its own place in ALLOWED
            if target in modules and target != name and (name == "bmeg" or not target.startswith(name + ".")):
                graph[name].add(target)
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_module_imports_from_a_layer_above_it() -> None:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for source, targets in _module_graph().items():
        for target in targets:
            pair = (_layer(source), _layer(target))
            if pair[0] != pair[1]:
                edges[pair].append(f"{source} -> {target}")
    assert set(ALLOWED) >= {layer for pair in edges for layer in pair}, "a new subpackage needs its place in ALLOWED"
    broken = {pair: where for pair, where in edges.items()
              if "*" not in ALLOWED[pair[0]] and pair[1] not in ALLOWED[pair[0]]}
    assert not broken, f"imports from a layer above: {broken}"


def _below(layer: str) -> set[str]:
    """Every layer `layer` may reach through ALLOWED, directly or not."""
    seen: set[str] = set()
    todo = list(ALLOWED[layer] - {"*"})
    while todo:
        nxt = todo.pop()
        if nxt not in seen:
            seen.add(nxt)
            todo.extend(ALLOWED[nxt] - {"*"})
    return seen


def test_the_layers_are_an_order() -> None:
    """No layer may reach itself through ALLOWED, so the layers stack; the shared cluster
    primitives are below both of their users, which never import each other's way up."""
    for layer in ALLOWED:
        if "*" not in ALLOWED[layer]:
            assert layer not in _below(layer), f"{layer} can reach itself through ALLOWED"
    assert "cluster" in _below("faultinject") and "cluster" in _below("mitigation")
    assert not _below("cluster") & {"faultinject", "mitigation", "models", "graphs"}
    assert "mitigation" not in _below("faultinject")


def test_no_import_circles() -> None:
    graph = _module_graph()
    circles = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def test_no_test_module_imports_another() -> None:
    """What several tests share lives in `builders.py` and the conftest plugins, never in a
    `test_*` module (importing one runs its module-level set-up and ties the two together)."""
    offenders = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[-1].startswith("test_")]
    assert not offenders, f"test modules importing test modules: {offenders}"


def test_the_command_and_its_help_load_without_torch():
    # the options' defaults and choices come from the library's torch-free modules
    # (bmeg.training.config, bmeg.datasets.generate), so listing them never loads the models
    script = ("import sys\nfrom click.testing import CliRunner\nfrom bmeg.cli import COMMANDS, main\n"
              "for name in ['', *COMMANDS]:\n"
              "    result = CliRunner().invoke(main, [name, '--help'] if name else ['--help'])\n"
              "    assert result.exit_code == 0, (name, result.output)\n"
              "print(sorted(m for m in ('torch', 'torch_geometric') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
