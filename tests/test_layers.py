"""prima's packages form layers: each imports only those below it, as the README's Layout section
lists them, so no package imports another that imports it back. Read from the source with ast
(every import counts, also those inside functions or under TYPE_CHECKING)."""

from __future__ import annotations

import ast
import re
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


def imported_units(path: Path) -> set[str]:
    """The units of prima that `path` imports (relative imports resolved)."""
    module = list(path.relative_to(ROOT).with_suffix("").parts)
    if module[-1] == "__init__":
        module.pop()
        package = module
    else:
        package = module[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = base + (node.module.split(".") if node.module else [])
            # `from prima import metrics` imports the unit named by the alias.
            targets = [target + [alias.name] for alias in node.names] if target == ["prima"] else [target]
        else:
            continue
        for target in targets:
            if len(target) > 1 and target[0] == "prima":
                found.add(target[1])
    return found


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
