"""The import rules that keep the three processes apart, checked by reading every module's imports.

healthd runs as three programs: the node agent (healthd.agent), the Slurm hooks (healthd.hooks) and
the head-node controller (healthd.controller). They never import each other. What more than one of
them uses lives in the shared floor: the top-level modules of the package, which import only the
standard library, each other and the declared dependencies. healthd.slurm, the one edge to Slurm,
serves the hooks and the controller and imports only the floor. The simulator (healthd.sim) runs
the controller's and the agent's own code on a virtual clock, so it may import any room; no room
imports it.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "healthd"
ROOMS = ("agent", "hooks", "controller", "slurm", "sim")
DECLARED = {"yaml", "prometheus_client", "pynvml", "systemd", "pyslurm", "ClusterShell"}
"""Third-party imports the floor and the rooms may use (pyproject's dependencies and extras)."""


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted (absolute)
    names: tuple[str, ...]
    line: int
    nested: bool  # inside a function
    comment: str  # the source line and the one above it


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> list[Import]:
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    name = module_name(path)
    out: list[Import] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                text = "\n".join(lines[max(0, child.lineno - 2): child.end_lineno])
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        out.append(Import(name, alias.name, (), child.lineno, nested, text))
                else:
                    base = child.module or ""
                    if child.level:
                        pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                        pkg = pkg[: len(pkg) - child.level + 1]
                        base = ".".join([*pkg, base] if base else pkg)
                    out.append(Import(name, base, tuple(a.name for a in child.names), child.lineno, nested, text))
            visit(child, inner)

    visit(tree, False)
    return out


ALL = [imp for p in sorted(PACKAGE.rglob("*.py")) for imp in imports_of(p)]


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ROOMS and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "floor"


def healthd_targets(imp: Import) -> list[str]:
    """The healthd modules an import reaches (`from healthd import x` reaches healthd.x)."""
    if imp.target != "healthd" and not imp.target.startswith("healthd."):
        return []
    if imp.target == "healthd":
        return [f"healthd.{n}" for n in imp.names if n != "__version__"] or ["healthd"]
    return [imp.target]


def test_the_rules_see_every_room():
    rooms = {room_of(i.module) for i in ALL}
    assert rooms == {"floor", *ROOMS}
    assert len(ALL) > 300


@pytest.mark.parametrize("room", ["agent", "hooks", "controller"])
def test_the_three_processes_never_import_each_other(room):
    wrong = [f"{i.module}:{i.line} imports {t}" for i in ALL if room_of(i.module) == room
             for t in healthd_targets(i) if room_of(t) in {"agent", "hooks", "controller"} - {room}]
    assert not wrong, "\n".join(wrong)


def test_no_room_imports_the_simulator():
    wrong = [f"{i.module}:{i.line} imports {t}" for i in ALL if room_of(i.module) != "sim"
             for t in healthd_targets(i) if room_of(t) == "sim"]
    assert not wrong, "\n".join(wrong)


def test_the_agent_does_not_talk_to_slurm():
    wrong = [f"{i.module}:{i.line} imports {t}" for i in ALL if room_of(i.module) == "agent"
             for t in healthd_targets(i) if room_of(t) == "slurm"]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("room", ["floor", "slurm"])
def test_the_floor_and_the_slurm_edge_import_only_the_floor(room):
    allowed = {"floor"} if room == "floor" else {"floor", "slurm"}
    wrong = [f"{i.module}:{i.line} imports {t}" for i in ALL if room_of(i.module) == room
             for t in healthd_targets(i) if room_of(t) not in allowed]
    assert not wrong, "\n".join(wrong)


def test_everything_else_imported_is_the_standard_library_or_declared():
    foreign = sorted({f"{i.module} imports {i.target}" for i in ALL
                      if i.target.split(".")[0] not in {"healthd", "__future__", *sys.stdlib_module_names, *DECLARED}})
    assert not foreign, "\n".join(foreign)


def test_no_module_imports_another_modules_private_names():
    wrong = [f"{i.module}:{i.line} imports {n} from {i.target}" for i in ALL if healthd_targets(i)
             for n in i.names if n.startswith("_") and not n.startswith("__")]
    assert not wrong, "\n".join(wrong)


def test_no_module_reaches_into_another_modules_private_attributes():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("healthd") for a in n.names}
        modules |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names if a.name.startswith("healthd")}
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules
                    and n.attr.startswith("_") and not n.attr.startswith("__")):
                wrong.append(f"{module_name(path)}:{n.lineno} uses {n.value.id}.{n.attr}")
    assert not wrong, "\n".join(wrong)


def test_every_function_level_import_says_why():
    """An import inside a function is kept only to spare a hook's start (or an optional dependency's
    absence); the line or the one above it says so."""
    bare = [f"{i.module}:{i.line} imports {i.target}" for i in ALL if i.nested and "#" not in i.comment]
    assert not bare, "\n".join(bare)
