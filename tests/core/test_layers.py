"""`rollkeep.core` is layered (docs/layout.md): a module imports only from its own layer or
the layers below it, no two modules import each other (directly or round a cycle), and the
core imports nothing from the rest of rollkeep and never waits (no asyncio).

Every import counts, at module level or inside a function (a lazy import is a dependency
too); the check reads the source with `ast`, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import rollkeep.core

CORE = Path(rollkeep.core.__file__).parent
# Bottom to top. `errors` and `crashpoints` are the foundation every layer may use.
LAYERS = ("errors crashpoints", "io", "custody", "rollout", "rowlog", "checkpoint", "journal", "restore",
          "schedule")
RANK = {name: i for i, names in enumerate(LAYERS) for name in names.split()}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = path.relative_to(CORE).with_suffix("").parts
        name = ".".join(("rollkeep", "core") + parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The rollkeep modules `name` imports (a `from P import m` of a submodule names it)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:
                sub = f"{module}.{a.name}"
                found.add(sub if sub in MODULES else module)
    return {m for m in found if m == "rollkeep" or m.startswith("rollkeep.") or m == "asyncio"} - {name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int:
    top = name.split(".")[2]
    assert top in RANK, f"{name}: its layer is not in LAYERS (add it there and to docs/layout.md)"
    return RANK[top]


def test_every_core_module_has_a_layer():
    for name in MODULES:
        if name != "rollkeep.core":
            _layer(name)


def test_no_module_imports_a_layer_above_its_own():
    upward = [(m, d) for m, deps in GRAPH.items() if m != "rollkeep.core"
              for d in deps if d.startswith("rollkeep.core.") and _layer(d) > _layer(m)]
    assert upward == []


def test_the_core_imports_nothing_from_the_rest_of_rollkeep_and_never_waits():
    outside = [(m, d) for m, deps in GRAPH.items() for d in deps if not d.startswith("rollkeep.core")]
    assert outside == []


def test_no_import_cycles():
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for d in sorted(GRAPH.get(m, ())):
            if d not in GRAPH:
                continue
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_check_sees_an_upward_import_and_a_cycle():
    # The checks above would pass vacuously if `_imports` found nothing.
    assert "rollkeep.core.custody.ledger" in GRAPH["rollkeep.core.schedule.scheduler"]
    assert "rollkeep.core.errors" in GRAPH["rollkeep.core.custody.ledger"]
    assert "rollkeep.core.rollout.rows" in GRAPH["rollkeep.core.rollout.rowstore"]
    assert _layer("rollkeep.core.schedule.scheduler") > _layer("rollkeep.core.custody.ledger")
