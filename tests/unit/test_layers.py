"""The import layering of docs/layers.md: no module imports a higher layer, and no modules import
each other in a circle. Every import that can run counts, the ones inside functions too (not those
under ``if TYPE_CHECKING:``). Reads the sources with ``ast``: no model, Ray or MLflow is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("foreserve", "app", "predictor", "deployments", "autoscale", "loadtests", "scripts")

# Most specific prefix first: a module's layer is that of the first prefix it is or lies under. Every
# top-level package spans one layer or adjacent ones, in this order, so packages import each other
# in one direction only (test_no_cycle_between_top_level_packages).
LAYERS: tuple[tuple[str, int], ...] = (
    ("predictor.training", 1),  # dataset, training, registering, retraining
    ("predictor", 0),  # the serving side: the engine depends on its interface (base, buckets)
    ("app", 2),  # the core library: paths, runtime_env, config, api, engine, prepare, batch io and API objects
    ("autoscale", 3),  # autoscaling policy, signals, decisions; planning
    ("deployments", 4),  # Ray Serve
    ("loadtests", 5),  # Locust load tests and benchmarks
    ("foreserve", 6),  # the entry points: the `foreserve` command, `prepare`, the batch job
    ("scripts", 6),  # research probes: they drive the CLI
)


def layer_of(module: str) -> int:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and docs/layers.md)")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _runnable(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but the bodies of ``if TYPE_CHECKING:`` (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def imports(path: Path, modules: dict[str, Path]) -> Iterator[tuple[int, str, str]]:
    """(line, imported project module, the statement) for every import of a project module in ``path``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    source = path.read_text()
    for node in _runnable(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] in PACKAGES:
                yield node.lineno, target, ast.get_source_segment(source, node) or target


def graph() -> dict[str, list[tuple[str, str]]]:
    """module -> [(imported module, "path:line: statement")]."""
    modules = project_modules()
    edges: dict[str, list[tuple[str, str]]] = {m: [] for m in modules}
    for module, path in modules.items():
        for line, target, statement in imports(path, modules):
            if target != module:
                where = f"{path.relative_to(ROOT)}:{line}"
                edges[module].append((target, f"{where}: {' '.join(statement.split())}"))
    return edges


def test_every_module_has_a_layer():
    for module in project_modules():
        layer_of(module)


def test_the_walk_sees_imports_inside_functions_and_modules_named_by_from():
    targets = {target for target, _ in graph()["foreserve.cli.serve"]}
    # cmd_serve's `from app import paths` and `from foreserve.prepare import prepare`
    assert {"app.paths", "foreserve.prepare", "deployments.launch"} <= targets


def test_no_module_imports_a_higher_layer():
    upward = []
    for module, targets in graph().items():
        for target, where in targets:
            if layer_of(target) > layer_of(module):
                upward.append(f"{where}  (L{layer_of(module)} {module} imports L{layer_of(target)} {target})")
    assert not upward, "imports of a higher layer (docs/layers.md):\n" + "\n".join(sorted(upward))


def strongly_connected(edges: dict[str, list[tuple[str, str]]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child, _ in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def shortest_cycle(edges: dict[str, list[tuple[str, str]]], start: str, members: set[str]) -> list[str]:
    """The statements of a shortest circle of imports from ``start`` back to it, within ``members``."""
    came_from: dict[str, tuple[str, str]] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target, where in edges[module]:
                if target not in members or target in came_from:
                    continue
                came_from[target] = (module, where)
                if target == start:
                    path, node = [], start
                    while True:
                        node, where = came_from[node]
                        path.append(where)
                        if node == start:
                            return path[::-1]
                following.append(target)
        frontier = following
    return []


def test_no_import_cycle():
    edges = graph()
    cycles: dict[frozenset[str], list[str]] = {}  # a circle once, whichever module it was found from
    for component in strongly_connected(edges):
        for module in component:
            cycle = shortest_cycle(edges, module, set(component))
            cycles.setdefault(frozenset(cycle), cycle)
    report = sorted("\n    ".join(cycle) for cycle in cycles.values())
    assert not report, "modules that import each other in a circle (cut one import of each):\n    " + "\n\n    ".join(report)


def test_no_cycle_between_top_level_packages():
    edges: dict[str, list[tuple[str, str]]] = {p: [] for p in PACKAGES}
    for module, targets in graph().items():
        for target, where in targets:
            if target.split(".")[0] != module.split(".")[0]:
                edges[module.split(".")[0]].append((target.split(".")[0], where))
    cycles = [" <-> ".join(component) for component in strongly_connected(edges)]
    shown = {(m.split(".")[0], t.split(".")[0]): w for m, ts in graph().items() for t, w in ts}
    assert not cycles, "top-level packages that import each other: " + "; ".join(cycles) + "\n" + "\n".join(
        f"{a} -> {b}: {w}" for (a, b), w in sorted(shown.items()) if a != b)
