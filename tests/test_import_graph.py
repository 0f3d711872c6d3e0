"""No import circle anywhere in healthd/ and no class over 400 lines, read with ast from every module.

Every import counts, wherever it stands: at module level, inside a function, or under TYPE_CHECKING (a
circle a type checker has to untie is a circle a reader has to untie too). A class over 400 lines holds
more than one responsibility: split it along what it does, as the ledger and the Slurm edge are split.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "healthd"
MAX_CLASS_LINES = 400


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _known(target: str) -> str | None:
    """The healthd module an import reaches: the longest known prefix of `target`."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def imports(module: str) -> set[str]:
    """The healthd modules `module` imports (`from a import b` reaches a.b when that is a module)."""
    path = MODULES[module]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out.update(t for t in map(_known, targets) if t is not None and t != module)
    return out


GRAPH = {m: imports(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_controller():
    controller = [m for m in GRAPH if m.startswith("healthd.controller.")]
    assert len(controller) > 20 and "healthd.controller.ownership" in GRAPH["healthd.controller.gates"]


def test_cycles_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_healthd():
    found = cycles(GRAPH)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def class_lengths() -> dict[str, int]:
    """module.Class -> its lines, decorators and docstring included, for every class of healthd/."""
    out: dict[str, int] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                out[f"{module}.{node.name}"] = node.end_lineno - start + 1
    return out


def test_no_class_over_400_lines():
    lengths = class_lengths()
    assert lengths["healthd.controller.executor.Executor"] > 100  # the walk sees the big ones
    over = {name: n for name, n in lengths.items() if n > MAX_CLASS_LINES}
    assert not over, f"classes over {MAX_CLASS_LINES} lines: {over}"
