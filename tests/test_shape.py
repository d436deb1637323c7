"""The shape of the code: statuses are written in one place only.

A status change that forgets its counter is the classic bug of a claim protocol; one named
function per transition keeps both together, in fanout/transitions/. This walks the syntax of
every module of fanout and finds each status write: ``.status = ...``, ``status=`` given to
``update()`` (directly, or in a dict splatted into it), and SQL text that sets a status.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

FANOUT = Path(__file__).resolve().parent.parent / "fanout"
HOME = "fanout/transitions/"
# The SQL fast paths write statuses in SQL of their own (the hand-over's PL/pgSQL function
# and MariaDB procedure); they implement transitions.items.hand_over, and live where Django
# keeps schema SQL.
SQL_HOMES = ("fanout/migrations/", "fanout/backends/")
# Writes outside the transitions package that are still to move there.
STRAYS: dict[str, int] = {}

_SETS_STATUS = re.compile(r"\bSET\b[^;]*?\bstatus\s*=", re.IGNORECASE | re.DOTALL)
_UPDATES = ("update", "update_or_create", "bulk_update")


def _is_status_dict(node: ast.expr) -> bool:
    """A dict literal or dict(...) call with a status key."""
    if isinstance(node, ast.Dict):
        return any(isinstance(k, ast.Constant) and k.value == "status" for k in node.keys)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return any(kw.arg == "status" for kw in node.keywords)
    return False


def _status_dicts(tree: ast.Module) -> set[str]:
    """Names bound to a status dict, and functions returning one, anywhere in the module."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_status_dict(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.FunctionDef):
            returns = [r for r in ast.walk(node) if isinstance(r, ast.Return) and r.value]
            if any(_is_status_dict(r.value) for r in returns if r.value is not None):
                names.add(node.name)
    return names


def _is_lock(value: ast.expr) -> bool:
    """``status=F("status")``: a write that changes nothing, taken for its lock (SQLite)."""
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "F"
        and any(isinstance(a, ast.Constant) and a.value == "status" for a in value.args)
    )


def _splats_status(value: ast.expr, dicts: set[str]) -> bool:
    if _is_status_dict(value):
        return True
    if isinstance(value, ast.Name):
        return value.id in dicts
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        return value.func.id in dicts
    return False


def status_writes(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) of each status write in the module's source."""
    tree = ast.parse(source)
    dicts = _status_dicts(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Attribute) and t.attr == "status" for t in targets):
                yield node.lineno, ".status ="
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _UPDATES
        ):
            for kw in node.keywords:
                if kw.arg == "status" and not _is_lock(kw.value):
                    yield node.lineno, f"{node.func.attr}(status=...)"
                elif kw.arg is None and _splats_status(kw.value, dicts):
                    yield node.lineno, f"{node.func.attr}(**status)"
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _SETS_STATUS.search(node.value)
        ):
            yield node.lineno, "SQL SET status"


def writes_by_module() -> dict[str, list[tuple[int, str]]]:
    found: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(FANOUT.rglob("*.py")):
        name = path.relative_to(FANOUT.parent).as_posix()
        writes = sorted(set(status_writes(path.read_text())))
        if writes:
            found[name] = writes
    return found


def test_no_status_is_written_outside_the_transitions_package() -> None:
    found = writes_by_module()
    outside = {
        name: writes
        for name, writes in found.items()
        if not name.startswith(HOME) and not name.startswith(SQL_HOMES)
    }
    counts = {name: len(writes) for name, writes in outside.items()}

    assert counts == STRAYS, f"status writes outside {HOME}: {outside}"


def test_the_walk_finds_each_kind_of_status_write() -> None:
    # The check above can fail: each form it looks for is found in a module that has it.
    source = """
held = dict(status="pending", owner="")
def _running():
    return dict(status="running")
run.status = "failed"
Item.objects.filter(pk=1).update(status="failed")
Item.objects.filter(pk=1).update(**held)
Item.objects.filter(pk=1).update(**_running())
Item.objects.filter(pk=1).update(**{"status": "x"})
Run.objects.filter(pk=1).update(status=F("status"))
Item.objects.filter(pk=1).update(owner="")
cursor.execute("UPDATE fanout_itemclaim SET owner = %s, status = 'failed' WHERE id = %s")
"""
    kinds = [what for _, what in sorted(status_writes(source))]

    assert kinds == [
        ".status =",
        "update(status=...)",
        "update(**status)",
        "update(**status)",
        "update(**status)",
        "SQL SET status",
    ]


def test_the_sql_fast_paths_are_the_only_sql_that_sets_a_status() -> None:
    found = writes_by_module()
    sql = sorted(
        name for name, writes in found.items() if any(w == "SQL SET status" for _, w in writes)
    )

    assert sql and all(name.startswith(SQL_HOMES) for name in sql), sql


# Layers: every fanout module imports downward only, at its top. A module that needs a lazy
# import of another to avoid a circle is in the wrong layer: move the code, not the import.

# Django imports the AppConfig's module before the models load, so it imports the modules that
# use them in ready(): the one place a fanout module may import another inside a function.
APP_CONFIG = "fanout.apps"
# Optional extras a module may load inside a function, so that fanout imports without them.
EXTRAS = ("opentelemetry", "prometheus_client")
# Function-level imports still to move to the top of their modules, by module: none of them
# closes a circle (test_no_fanout_module_is_part_of_an_import_cycle counts them).
STRAY_IMPORTS: dict[str, int] = {}
# The core: the protocol's rows, clock, limits, transitions, claim, record and join. It
# imports nothing from the layers above it (executors, composition, observation, admin,
# commands), which fanout.launch lets start runs for it.
CORE = {
    "fanout.backends",
    "fanout.backends.base",
    "fanout.backends.mysql",
    "fanout.backends.postgresql",
    "fanout.backends.sqlite",
    "fanout.claim",
    "fanout.clock",
    "fanout.conf",
    "fanout.cost",
    "fanout.definition",
    "fanout.discover",
    "fanout.errors",
    "fanout.join",
    "fanout.launch",
    "fanout.lease",
    "fanout.models",
    "fanout.nest",
    "fanout.options",
    "fanout.pools",
    "fanout.record",
    "fanout.signals",
    "fanout.spend",
    "fanout.stall",
    "fanout.text",
    "fanout.transitions",
    "fanout.transitions.items",
    "fanout.transitions.runs",
}


def module_sources() -> dict[str, str]:
    """{dotted module name: source} of every module of fanout but its migrations."""
    found = {}
    for path in sorted(FANOUT.rglob("*.py")):
        parts = list(path.relative_to(FANOUT.parent).with_suffix("").parts)
        if "migrations" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path.read_text()
    return found


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def _targets(node: ast.Import | ast.ImportFrom, module: str, package: bool) -> list[str]:
    """The dotted names an import may bring in: ``from .a import b`` brings in ``fanout.a.b``
    if that is a module, else ``fanout.a`` (the caller keeps the modules that exist)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        parts = parts[: len(parts) - node.level + (1 if package else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


Found = Iterator[tuple[int, list[str], str | None]]


def imports(module: str, source: str, package: bool = False) -> Found:
    """(line, the names it may bring in, enclosing function or None) of each import outside
    ``if TYPE_CHECKING:`` blocks."""

    def walk(node: ast.AST, function: str | None) -> Found:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child.lineno, _targets(child, module, package), function
            inner = (
                child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else None
            )
            yield from walk(child, inner or function)

    yield from walk(ast.parse(source), None)


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """{module: the fanout modules it imports, at its top or inside a function}."""
    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        package = f"{module}.__init__" in sources or _is_package(module)
        graph[module] = {
            _module_of(names, sources) for _, names, _ in imports(module, source, package)
        } - {module, ""}
    return graph


def _module_of(names: list[str], sources: dict[str, str]) -> str:
    """The first of an import's names that is a fanout module, or ""."""
    return next((name for name in names if name in sources), "")


def _is_package(module: str) -> bool:
    return (FANOUT.parent / module.replace(".", "/") / "__init__.py").exists()


def function_imports(sources: dict[str, str]) -> dict[str, list[str]]:
    """{module: "line: function imports name"} of imports of fanout modules inside functions,
    but the AppConfig's and the optional extras'."""
    found: dict[str, list[str]] = {}
    for module, source in sources.items():
        if module == APP_CONFIG:
            continue
        for line, names, function in imports(module, source, _is_package(module)):
            name = _module_of(names, sources)
            if function is not None and name and name.split(".")[0] not in EXTRAS:
                found.setdefault(module, []).append(f"{line}: {function} imports {name}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
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
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_fanout_module_imports_another_inside_a_function() -> None:
    found = function_imports(module_sources())
    counts = {module: len(lines) for module, lines in found.items()}

    assert counts == STRAY_IMPORTS, f"fanout modules imported inside functions: {found}"


def test_no_fanout_module_is_part_of_an_import_cycle() -> None:
    # Function-level imports count: a lazy import hides a circle, it does not break it.
    assert cycles(import_graph(module_sources())) == []


def test_the_core_imports_nothing_from_the_layers_above_it() -> None:
    graph = import_graph(module_sources())
    upward = {module: sorted(graph.get(module, set()) - CORE) for module in sorted(CORE)}

    assert {module: names for module, names in upward.items() if names} == {}


PLANTED = {
    "fanout.low": "from .high import lift\n",
    "fanout.high": (
        "from typing import TYPE_CHECKING\n"
        "from . import low\n"
        "if TYPE_CHECKING:\n"
        "    from .top import Hint\n"
        "def lift():\n"
        "    from .top import way_up\n"
        "    from opentelemetry import trace\n"
        "    import json\n"
    ),
    "fanout.top": "import fanout.low\n",
    "fanout.apps": "def ready():\n    from . import top\n",
}


def test_the_walk_finds_a_function_level_import_and_each_import_cycle() -> None:
    # The checks above can fail: a planted lazy import is found (not the AppConfig's, not an
    # extra, not one for type checking), and so are a top-level circle and one closed lazily.
    assert function_imports(PLANTED) == {"fanout.high": ["6: lift imports fanout.top"]}
    graph = import_graph(PLANTED)
    assert graph["fanout.high"] == {"fanout.low", "fanout.top"}
    assert cycles(graph) == [["fanout.high", "fanout.low", "fanout.top"]]
    del graph["fanout.high"]  # without the lazy import of top (and low's of high), no circle
    assert cycles(graph) == []


# Facts patched onto model instances (``run.fanout_progress = ...``, read back with getattr and
# a default) are invisible to a reader of the model and to a type checker: a page's facts travel
# in a mapping of their own (fanout.admin.common.page_facts).
PATCHED_PREFIX = "fanout_"


def patched_attributes(source: str) -> Iterator[tuple[int, str]]:
    """(line, name) of each ``obj.fanout_x = ...`` (plain, annotated, augmented, or among
    several targets) and ``setattr(obj, "fanout_x", ...)`` in the module's source."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and part.attr.startswith(PATCHED_PREFIX):
                        yield node.lineno, part.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith(PATCHED_PREFIX)
        ):
            yield node.lineno, node.args[1].value


def test_no_fanout_module_patches_fanout_attributes_onto_objects() -> None:
    found = {
        module: sorted(set(patched_attributes(source)))
        for module, source in module_sources().items()
    }

    assert {module: names for module, names in found.items() if names} == {}


def test_the_walk_finds_each_kind_of_patched_attribute() -> None:
    # The check above can fail: each form is found, and a plain name or another prefix is not.
    source = """
run.fanout_progress = 1
item.fanout_waits, item.fanout_held = why
pool.fanout_admitted += 1
row.fanout_now: datetime = now
setattr(pool, "fanout_reason", "")
fanout_total = 2
run.progress = 3
setattr(pool, "reason", "")
"""
    assert [name for _, name in sorted(patched_attributes(source))] == [
        "fanout_progress",
        "fanout_held",
        "fanout_waits",
        "fanout_admitted",
        "fanout_now",
        "fanout_reason",
    ]
