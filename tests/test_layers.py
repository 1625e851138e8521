"""prima's packages form layers: each imports only those below it, as the README's Layout section
lists them, so no package imports another that imports it back; and no module, within a package
either, imports itself through others. Read from the source with ast (every import counts, also
those inside functions or under TYPE_CHECKING)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "prima"


def documented_layers() -> list[list[str]]:
    """The layer order from the README: the first code block after 'Layers, bottom to top', one
    layer per line, the names on a line separated by spaces."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"Layers, bottom to top.*?```\n(.*?)```", text, re.S)
    assert block, "README.md's Layout section must list the layers (see this test's docstring)"
    return [line.split() for line in block.group(1).splitlines() if line.strip()]


def unit_of(path: Path) -> str:
    """The top-level unit of prima a source file belongs to: its subpackage, or the module."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def module_name(path: Path) -> str:
    """The dotted name Python imports a source file under: prima/a/b.py is prima.a.b."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(path: Path) -> Iterator[tuple[str, list[str]]]:
    """Each import statement in `path` as the module it names (relative imports resolved) and the
    names it takes from it: `import a.b` gives ("a.b", []), `from . import c` in a/b.py ("a", ["c"])."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = base + (node.module.split(".") if node.module else [])
            yield ".".join(target), [alias.name for alias in node.names]


def imported_units(path: Path) -> set[str]:
    """The units of prima that `path` imports (relative imports resolved)."""
    found: set[str] = set()
    for target, names in imports_in(path):
        parts = target.split(".")
        if parts == ["prima"]:
            found.update(names)  # `from prima import metrics` imports the unit named by the alias
        elif len(parts) > 1 and parts[0] == "prima":
            found.add(parts[1])
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of prima and the modules of prima it imports. `from pkg import name` imports
    the module pkg.name when there is one, else pkg."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        found: set[str] = set()
        for target, names in imports_in(path):
            submodules = [f"{target}.{name}" for name in names]
            found.update(sub for sub in submodules if sub in paths)
            if target in paths and not all(sub in paths for sub in submodules):
                found.add(target)
        graph[module] = found - {module}
    return graph


def shortest_cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest chain of imports that leads from `start` back to itself, or None."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    cycle = [module]
                    while cycle[-1] != start:
                        cycle.append(came_from[cycle[-1]])
                    return cycle[::-1]
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    return None


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each module that is on one, each cycle listed once."""
    cycles: dict[frozenset[str], list[str]] = {}
    for module in sorted(graph):
        cycle = shortest_cycle_through(graph, module)
        if cycle is not None:
            cycles.setdefault(frozenset(cycle), cycle)
    return list(cycles.values())


def test_packages_import_only_layers_below_them() -> None:
    layers = documented_layers()
    level = {name: i for i, layer in enumerate(layers) for name in layer}
    sources = sorted(PACKAGE.rglob("*.py"))
    units = {unit_of(p) for p in sources} - {"__init__", "__main__"}
    missing = units - set(level)
    assert not missing, f"units not placed in the README's layer list: {sorted(missing)}"
    wrong = []
    for path in sources:
        unit = unit_of(path)
        if unit in ("__init__", "__main__"):
            continue
        for target in imported_units(path) - {unit}:
            if target in level and level[target] >= level[unit]:
                wrong.append(
                    f"{path.relative_to(ROOT)} ({unit}, layer {level[unit]}) imports {target} (layer {level[target]})"
                )
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_check_sees_relative_and_lazy_imports() -> None:
    """The parser resolves what the real tree uses: relative imports, imports inside functions."""
    pkg = PACKAGE / "daemon" / "runtime.py"
    assert {"engine", "net", "weights"} <= imported_units(pkg)
    assert "daemon" in imported_units(pkg)  # `from .head import Head`
    session = PACKAGE / "coordinator" / "session.py"
    assert "plan" in imported_units(session)  # imported inside _check_windows


def test_no_module_imports_itself_through_others() -> None:
    """Within a package too, imports flow one way: no module reaches itself through its imports,
    counting lazy imports and those for type checking, which are cycles in the design even when
    Python tolerates them at run time."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in cycles)


def test_the_cycle_check_finds_what_it_is_for() -> None:
    """The graph holds lazy and package-relative imports, and a cycle in it is found and named."""
    graph = import_graph()
    assert "prima.coordinator.members" in graph["prima.coordinator.session"]  # lazy, relative
    assert "prima.net.discovery" in graph["prima.coordinator.members"]  # from prima.net import discovery
    looped = {**graph, "prima.errors": graph["prima.errors"] | {"prima.api.server"}}
    cycle = shortest_cycle_through(looped, "prima.errors")
    assert cycle is not None
    assert cycle[:2] == ["prima.errors", "prima.api.server"]  # errors imports nothing else of prima
    assert all(
        b in looped[a] for a, b in zip(cycle, [*cycle[1:], cycle[0]], strict=True)
    )  # each imports the next
