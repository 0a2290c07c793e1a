"""The import rules of the package, read from the source (every import statement, also the ones
inside functions): the pure core knows no adapter, the engine knows no edge, only start-up knows
the simulator."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

GPUD = Path(__file__).resolve().parents[1] / "gpud"

# The start-up layer, above the engine and the adapters: the one seam that picks the real host or
# the simulator (hardware), the two entry points built on it (daemon, qualify) and their dispatch.
ABOVE = ("gpud.hardware", "gpud.daemon", "gpud.qualify", "gpud.check_offline", "gpud.main")

# package (or top-level module) -> packages of gpud it must never import
FORBIDDEN = {
    "layout": ("gpud.host", "gpud.engine", "gpud.api", "gpud.cli", "gpud.sim", *ABOVE),
    "plan": ("gpud.host", "gpud.engine", "gpud.api", "gpud.cli", "gpud.sim", *ABOVE),
    "host": ("gpud.engine", "gpud.api", "gpud.cli", "gpud.sim", *ABOVE),
    "engine": ("gpud.api", "gpud.cli", "gpud.sim", *ABOVE),
    "api": ("gpud.cli", "gpud.sim", *ABOVE),
    "sim": ("gpud.engine", "gpud.api", "gpud.cli", "gpud.host", *ABOVE),
    "hardware": ("gpud.api", "gpud.cli", "gpud.daemon", "gpud.qualify", "gpud.main"),
    # only hardware.py knows the simulator: the entry points drive whatever host it opened
    "qualify": ("gpud.api", "gpud.cli", "gpud.sim", "gpud.daemon", "gpud.main"),
    "daemon": ("gpud.cli", "gpud.sim", "gpud.qualify", "gpud.main"),
    "check_offline": ("gpud.cli", "gpud.sim", "gpud.daemon", "gpud.qualify", "gpud.main"),
    "main": ("gpud.sim",),
    # imported by both entry points before anything else (asyncio's first import): nothing of gpud
    "asyncio_tls": ("gpud",),
    # the client's contract: the standard library, msgspec and the MIG words (gpud.mig_text) only
    "wire": ("gpud.layout", "gpud.plan", "gpud.host", "gpud.engine", "gpud.api", "gpud.cli", "gpud.sim", *ABOVE),
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


def _files(package: str) -> list[Path]:
    module = GPUD / f"{package}.py"
    return [module] if module.is_file() else sorted((GPUD / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_layering(package):
    assert _files(package), f"gpud/{package} is gone: the rule above names nothing"
    bad = [f"{path.relative_to(GPUD.parent)} imports {name}"
           for path in _files(package)
           for name in sorted(_imports(path))
           if any(_within(name, banned) for banned in FORBIDDEN[package])]
    assert bad == []


# The planners: only the engine calls them (a preview for `gpudctl plan` included), so the pass
# order lives in one place and the API translates what the engine planned.
PLANNERS = ("gpud.plan.binding.plan_binding", "gpud.plan.mig.plan_gpu", "gpud.plan.vgpu.plan_vgpu",
            "gpud.plan.reset_scope.reset_takes_along")


def test_the_api_plans_nothing_itself():
    found = [f"{path.relative_to(GPUD.parent)} imports {name}" for path in _files("api")
             for name in sorted(_imports(path)) if name in PLANNERS]
    assert found == []
    engine = {name for path in _files("engine") for name in _imports(path)}
    assert set(PLANNERS) <= engine, "a planner the rule names is not the engine's any more: update PLANNERS"


# The engine's boundary (gpud.engine.engine): outside gpud/engine/ nothing holds the Reconciler;
# callers read the EngineView and send the Engine's commands.
RECONCILER = "gpud.engine.reconciler"


def _attributes(path: Path) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Attribute)}


def _outside_engine() -> list[Path]:
    return [p for p in sorted(GPUD.rglob("*.py")) if (GPUD / "engine") not in p.parents]


def test_nothing_outside_the_engine_touches_the_reconciler():
    imports = [f"{path.relative_to(GPUD.parent)} imports {name}" for path in _outside_engine()
               for name in sorted(_imports(path)) if _within(name, RECONCILER)]
    assert imports == []
    # the Engine's own hold on it is private: reaching through it is touching the Reconciler too
    reach = [str(path.relative_to(GPUD.parent)) for path in _outside_engine() if "_rec" in _attributes(path)]
    assert reach == []
    assert (GPUD / "engine" / "engine.py").is_file() and "_rec" in _attributes(GPUD / "engine" / "engine.py"), \
        "the Engine no longer holds the Reconciler as _rec: update this rule"


CLIENT_MAY_IMPORT = ("gpud.wire", "gpud.mig_text")  # the client's contract: one package, and the MIG words


def test_client_imports_of_gpud_are_only_the_protocol_modules():
    bad = [f"{path.name} imports {name}" for path in sorted((GPUD / "cli").glob("*.py"))
           for name in sorted(_imports(path))
           if _within(name, "gpud") and not (_within(name, "gpud.cli") or any(_within(name, m) for m in CLIENT_MAY_IMPORT)
                                             or name == "gpud")]
    assert bad == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(GPUD.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """gpud module -> the gpud modules it imports (at any depth of its code). `from P import x`
    is an edge to module P.x when there is one, else to P; a package's own __init__, which
    Python runs before any of its modules, is not an edge of theirs unless they name it: `from P
    import x` inside package P goes through P's face (its __init__), so it is an edge to P too."""
    files = {_module_name(p): p for p in GPUD.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for m, path in files.items():
        edges: set[str] = set()
        faces: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                          for a in node.names}
                faces.add(node.module)
        graph[m] = ({n for n in edges if n in files and n != m and not m.startswith(n + ".")}
                    | {n for n in faces if n in files and n != m and files[n].name == "__init__.py"})
    return graph


def _a_circle(graph: dict[str, set[str]]) -> list[str] | None:
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

    return next((c for m in sorted(graph) if (c := visit(m, [])) is not None), None)


def test_the_circle_finder_finds_a_circle():
    assert _a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_anywhere_under_gpud():
    graph = _graph()
    assert {"gpud.sim.kernel", "gpud.sim.vgpu", "gpud.qualify.main", "gpud.hardware"} <= set(graph)
    assert "gpud.sim.uevents" in graph["gpud.sim.vgpu"]  # the edges are read, not only the nodes
    assert _a_circle(graph) is None


def _module_file(name: str) -> Path | None:
    rel = Path(*name.split("."))
    for candidate in (GPUD.parent / rel.with_suffix(".py"), GPUD.parent / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_everything_the_client_loads_is_the_standard_library_msgpack_and_msgspec():
    """Followed through every gpud module the client reaches (the protocol modules' own imports too,
    and the imports inside functions): nothing outside the standard library, msgpack (what it reads
    the wire with) and msgspec (the structs, imported only to fill a field an older gpud did not
    send: gpud.cli.view) is ever loaded by a gpudctl run."""
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
    # the walk reached the protocol and the MIG words the client prints
    assert {GPUD / "wire" / "protocol.py", GPUD / "wire" / "replies.py", GPUD / "mig_text.py"} <= seen
    assert outside - set(sys.stdlib_module_names) - {"msgpack", "msgspec"} == set()


TESTS = GPUD.parent / "tests"


def _test_module_imports(path: Path) -> set[str]:
    """The test modules (test_*.py, conftest.py) that `path` imports, by dotted name."""
    out = set()
    for name in _imports(path):
        if _within(name, "tests") and any(part.startswith("test_") or part == "conftest" for part in name.split(".")[1:]):
            out.add(name)
    return out


def test_the_checker_sees_an_import_of_a_test_module(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from tests.kube.test_x import helper\n")
    assert _test_module_imports(f) == {"tests.kube.test_x", "tests.kube.test_x.helper"}


def test_no_module_under_tests_imports_a_test_module():
    """What tests share lives in tests/support/ (or a harness module of its folder), never in a test
    module: importing one runs its module-level code and collects nothing, and ties one test file's
    edits to another's."""
    found = {str(p.relative_to(TESTS)): sorted(_test_module_imports(p)) for p in sorted(TESTS.rglob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}
