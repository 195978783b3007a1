"""The package's shape: no import cycle between lit_smd's modules, no module past the size a reader can hold.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING``: a cycle hidden in a function
still makes two modules one unit to read and to change.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_smd"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The lit_smd modules that ``name`` (at ``path``) imports; ``from pkg import sub`` counts as importing ``pkg.sub``
    when ``sub`` is a module, else ``pkg``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {target for target in found if target in modules and target != name}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_reports_a_cycle_and_accepts_a_tree() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_relative_and_submodule_imports_resolve(tmp_path: Path) -> None:
    modules = {"lit_smd.kv": PACKAGE / "kv" / "__init__.py", "lit_smd.kv.cache": PACKAGE / "kv" / "cache.py",
               "lit_smd.rollout": PACKAGE / "rollout.py"}  # fmt: skip
    source = tmp_path / "__init__.py"
    source.write_text("from .cache import BudgetedCache\nfrom lit_smd import rollout\n")
    assert _imports("lit_smd.kv", source, modules) == {"lit_smd.kv.cache", "lit_smd.rollout"}


def test_no_import_cycle_inside_the_package() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40, "the package's modules were not found"
    cycle = _find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_not_longer_than_a_reader_can_hold(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines; split it (limit {MAX_LINES})"
