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
