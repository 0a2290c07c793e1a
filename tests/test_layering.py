"""The import rules of the package, read from the source (every import statement, also the ones
inside functions): the pure core knows no adapter, the engine knows no edge, only start-up knows
the simulator."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

GPUD = Path(__file__).resolve().parents[1] / "gpud"

# package -> packages of gpud it must never import
FORBIDDEN = {
    "layout": ("gpud.host", "gpud.engine", "gpud.api", "gpud.cli", "gpud.sim"),
    "plan": ("gpud.host", "gpud.engine", "gpud.api", "gpud.cli", "gpud.sim"),
    "host": ("gpud.engine", "gpud.api", "gpud.cli", "gpud.sim"),
    "engine": ("gpud.api", "gpud.cli", "gpud.sim"),
    "api": ("gpud.cli", "gpud.sim"),
    "sim": ("gpud.engine", "gpud.api", "gpud.cli", "gpud.host", "gpud.daemon", "gpud.qualify"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_layering(package):
    bad = [f"{path.relative_to(GPUD.parent)} imports {name}"
           for path in sorted((GPUD / package).rglob("*.py"))
           for name in sorted(_imports(path))
           if any(_within(name, banned) for banned in FORBIDDEN[package])]
    assert bad == []


def test_client_imports_of_gpud_are_only_the_wire_module():
    bad = [f"{path.name} imports {name}" for path in sorted((GPUD / "cli").glob("*.py"))
           for name in sorted(_imports(path))
           if _within(name, "gpud") and not (_within(name, "gpud.cli") or _within(name, "gpud.api.wire")
                                             or name in ("gpud.api", "gpud"))]
    assert bad == []


def _sim_graph() -> dict[str, set[str]]:
    """gpud.sim module -> the gpud.sim modules it imports (at any depth of its code)."""
    mods = {f"gpud.sim.{'.'.join(p.relative_to(GPUD / 'sim').with_suffix('').parts)}": p
            for p in (GPUD / "sim").rglob("*.py") if p.name != "__init__.py"}
    return {m: {n for name in _imports(p) for n in (name, name.rpartition(".")[0]) if n in mods and n != m}
            for m, p in mods.items()}


def test_no_import_circle_under_sim():
    graph = _sim_graph()
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for n in sorted(graph[m]):
            if (cycle := visit(n, path + [m])) is not None:
                return cycle
        done.add(m)
        return None

    assert [c for m in sorted(graph) if (c := visit(m, [])) is not None][:1] == []


def _module_file(name: str) -> Path | None:
    rel = Path(*name.split("."))
    for candidate in (GPUD.parent / rel.with_suffix(".py"), GPUD.parent / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_everything_the_client_loads_is_the_standard_library_and_msgspec():
    """Followed through every gpud module the client reaches (the wire module's own imports too):
    nothing outside the standard library and msgspec is ever loaded by a gpudctl run."""
    seen: set[Path] = set()
    todo = sorted((GPUD / "cli").glob("*.py"))
    outside: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            if _within(name, "gpud"):
                found = _module_file(name)
                if found is not None:
                    todo.append(found)
            else:
                outside.add(name.split(".")[0])
    assert GPUD / "mig_text.py" in seen  # the walk reached through the wire module
    assert outside - set(sys.stdlib_module_names) - {"msgspec"} == set()
