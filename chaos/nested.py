"""A tree of runs (orgs -> repos -> files) whose workers are killed while its leaves run.

The root is started with ``--no-wait``: no parent watches the tree. Two child runs kill the
worker that has just written them, before their parent item is recorded waiting (a crash between
spawning and recording); once the leaves are under way a busy worker is killed, then every
worker at once (a deploy), and new ones start. The tree heals by itself: one child run per
parent item at every level, every leaf's outcome from a finished execution, no leaf recorded
before a kill run again, no leaf run more often than kills cut it off, each parent's
``max_parallel`` bounding its running child runs, nothing left pending, running or waiting, and
the root's join counting every org.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from .crash import _died_mid_item
from .deploy import RESTART_SLACK
from .harness import Harness, Result, durable
from .ledger import calls, cut_off, max_overlap, span_end

SLEEP = "sleep=[0.05,0.25]"
# Parent items whose child run kills its writer once written: one at each level of children.
CRASH_SPAWN = ["o1", "o0/r1"]
LEVELS = ("chaos_nest_orgs", "chaos_nest_repos", "chaos_nest_files")


def nested(h: Harness, result: Result) -> None:
    from fanout.conf import conf
    from fanout.definition import get_definition
    from fanout.models import BatchRun, ItemClaim
    from fanout.nest import descendants
    from tests.testapp.models import Observation

    assert h.workers is not None
    orgs, repos, files = h.scale(4, 3), h.scale(4, 3), h.scale(16, 6)
    leaves = orgs * repos * files
    key = h.run_key("nested")
    args = ["run_fanout", LEVELS[0], "--executor", "rq", "--no-wait", "--run-key", key]
    for name, value in (("orgs", orgs), ("repos", repos), ("files", files)):
        args += ["--param", f"{name}={value}"]
    args += ["--param", SLEEP, "--param", f"crash_spawn={json.dumps(CRASH_SPAWN)}"]
    code, _, err = h.manage(args, "nested-start")
    result.check(code == 0, f"run_fanout --no-wait exited {code}: {err.strip()[-300:]}")
    root = h.run_id(key)

    def leaf_runs() -> list[int]:
        tree = descendants(root)
        return list(
            BatchRun.objects.filter(pk__in=tree, definition=LEVELS[2]).values_list("pk", flat=True)
        )

    def leaf_state() -> tuple[int, list[int], set[tuple[int, str]]]:
        """Leaves recorded, pids of the workers running leaves, and the recorded leaves."""
        items = ItemClaim.objects.filter(run_id__in=leaf_runs())
        done = set(items.filter(status="succeeded").values_list("run_id", "key"))
        owners = items.filter(status="running").values_list("owner", flat=True)
        return len(done), [int(o.split(":")[1]) for o in owners if o.count(":") >= 1], done

    # Kill a busy worker at a quarter of the leaves, every worker at half; before each kill,
    # note which leaves had their outcome recorded.
    recorded: list[tuple[float, set[tuple[int, str]]]] = []
    plan = [(0.25, "one"), (0.5, "all")]
    killed: list[str] = []
    healed_from = None
    deadline = time.monotonic() + 180
    while plan and time.monotonic() < deadline:
        share, what = plan[0]
        done, busy, seen = durable(leaf_state)
        mine = [p for p in busy if p in h.workers.pids()]
        if done / leaves >= 1.0:
            break
        if done / leaves < share or not mine:
            time.sleep(0.1)
            continue
        recorded.append((time.time(), seen))
        if what == "one":
            death = h.workers.kill_one(prefer=mine)
            killed.append("1" if death else "0")
        else:
            killed.append(str(h.workers.redeploy()))
            healed_from = time.monotonic()
        plan.pop(0)
    result.check(not plan, f"the leaves finished before the kills at {[s for s, _ in plan]}")
    finished = h.wait_finished([root], timeout=240)
    healed = time.monotonic() - healed_from if healed_from is not None else None
    result.check(finished, "the tree did not finish after the kills")
    tree = [root, *durable(lambda: descendants(root))]
    h.wait_handlers(tree)

    deaths = h.all_deaths()
    joins_cut = _cut_before_last(calls(tree, "join:"), deaths, lambda c: c.run_id)
    lease = get_definition(LEVELS[2]).lease_seconds
    fig = h.ledger(tree)
    h.judge(
        result,
        fig,
        lease=lease + float(conf.SUPERVISE_SECONDS) + RESTART_SLACK,
        joins_cut=dict(joins_cut),
    )
    durable(lambda: _check_tree(result, root, tree, (orgs, repos, files)))
    leaf_calls = durable(lambda: calls(leaf_runs()))
    _check_leaves(result, leaf_calls, recorded, deaths)
    spawned = durable(lambda: _check_spawn_crashes(result, tree))
    in_flight = durable(lambda: _children_in_flight(tree))
    leaf_limit = get_definition(LEVELS[2]).max_parallel
    by_run: dict[int, list[tuple[float, float]]] = defaultdict(list)
    now = time.time()
    for c in leaf_calls:
        by_run[c.run_id].append((c.started, span_end(c, deaths, now)))
    leaf_inflight = max((max_overlap(s) for s in by_run.values()), default=0)
    result.check(
        leaf_inflight <= leaf_limit,
        f"{leaf_inflight} leaves of one run at once over max_parallel {leaf_limit}",
    )
    for level, (most, limit) in in_flight.items():
        result.check(
            most <= limit,
            f"a {level} run had {most} child runs at once over max_parallel {limit}",
        )
    observed = durable(
        lambda: Observation.objects.filter(run_id__in=tree, name="chaos-spawn-exit").count()
    )
    result.figures["runs"] = "/".join(str(len(r)) for r in _by_level(tree).values())
    result.figures["leaves"] = leaves
    result.figures["spawn crashes"] = f"{observed}/{len(CRASH_SPAWN)} (respawned {spawned})"
    result.figures["kills"] = "+".join(killed)
    result.figures["died mid-item"] = _died_mid_item(fig.duplicates)
    result.figures["children in flight"] = ", ".join(
        f"{most}/{limit}" for most, limit in in_flight.values()
    )
    result.figures["leaf inflight"] = f"{leaf_inflight}/{leaf_limit}"
    result.figures["healed in"] = f"{healed:.0f}s" if healed is not None else "-"
    result.check(
        observed == len(CRASH_SPAWN),
        f"{observed} of {len(CRASH_SPAWN)} child runs killed their writer after spawning",
    )


def _cut_before_last(
    found: list[Any], deaths: dict[int, Any], group: Callable[[Any], Any]
) -> dict[Any, int]:
    """Per group (a run's join, a leaf), the calls before its last that a kill cut off.

    Only a call followed by another may have been cut off: the last one's outcome stands."""
    by: dict[Any, list[Any]] = defaultdict(list)
    for c in found:
        by[group(c)].append(c)
    return {g: sum(cut_off(c, deaths) for c in mine[:-1]) for g, mine in by.items()}


def _by_level(tree: list[int]) -> dict[str, list[Any]]:
    from fanout.models import BatchRun

    runs: dict[str, list[Any]] = {name: [] for name in LEVELS}
    for run in BatchRun.objects.filter(pk__in=tree).order_by("pk"):
        runs.setdefault(run.definition, []).append(run)
    return runs


def _check_tree(result: Result, root: int, tree: list[int], sizes: tuple[int, int, int]) -> None:
    """Every run succeeded and joined what it had; one child run per parent item."""
    from fanout.models import BatchRun, ItemClaim

    orgs, repos, files = sizes
    runs = _by_level(tree)
    want = {LEVELS[0]: 1, LEVELS[1]: orgs, LEVELS[2]: orgs * repos}
    got = {name: len(r) for name, r in runs.items()}
    result.check(got == want, f"the tree has runs {got}, expected {want}")
    top = BatchRun.objects.get(pk=root)
    joined = {"count": orgs, "statuses": {"succeeded": orgs}, "run": root}
    result.check(top.status == "succeeded", f"the root run ended {top.status}: {top.error[:200]}")
    result.check(top.join_result == joined, f"the root joined {top.join_result}, not {joined}")
    for name, level in runs.items():
        for run in level:
            n = run.total_items
            ok = run.status == "succeeded" and run.join_result == {
                "count": n,
                "statuses": {"succeeded": n},
                "run": run.pk,
            }
            if not result.check(ok, f"{name} run {run.pk} ended {run.status} {run.join_result}"):
                return
    parents = ItemClaim.objects.filter(run_id__in=tree, run__definition__in=LEVELS[:2])
    children = Counter(
        BatchRun.objects.filter(pk__in=tree, parent_item__isnull=False).values_list(
            "parent_item_id", flat=True
        )
    )
    orphans = [p.key for p in parents if children.get(p.pk, 0) != 1]
    result.check(
        not orphans and sum(children.values()) == parents.count(),
        f"parent items without exactly one child run: {orphans[:5]}",
    )
    # A parent item took its child run's outcome.
    child_result = dict(
        BatchRun.objects.filter(pk__in=tree, parent_item__isnull=False).values_list(
            "parent_item_id", "join_result"
        )
    )
    wrong = [p.key for p in parents if p.result != child_result.get(p.pk)]
    result.check(not wrong, f"parent items whose result is not their child's join: {wrong[:5]}")


def _check_leaves(
    result: Result,
    leaf_calls: list[Any],
    recorded: list[tuple[float, set[tuple[int, str]]]],
    deaths: dict[int, Any],
) -> None:
    """A leaf runs again only after a kill cut it off; a leaf recorded before a kill never."""
    by_leaf: dict[tuple[int, str], list[Any]] = defaultdict(list)
    for c in leaf_calls:
        by_leaf[(c.run_id, c.key)].append(c)
    cut = _cut_before_last(leaf_calls, deaths, lambda c: (c.run_id, c.key))
    over = [
        f"{leaf[1]} of run {leaf[0]} ran {len(mine)} times, {cut.get(leaf, 0)} cut off"
        for leaf, mine in by_leaf.items()
        if len(mine) > 1 + cut.get(leaf, 0)
    ]
    for text in over[:3]:
        result.check(False, text)
    again = [
        f"{key} of run {run}"
        for at, seen in recorded
        for (run, key) in seen
        if any(c.started > at for c in by_leaf.get((run, key), []))
    ]
    result.check(not again, f"leaves recorded before a kill ran again: {again[:5]}")
    result.figures["leaf runs"] = "/".join(
        f"{n}x{k}" for n, k in sorted(Counter(len(m) for m in by_leaf.values()).items())
    )


def _check_spawn_crashes(result: Result, tree: list[int]) -> int:
    """Each child run that killed its writer was spawned again by its reclaimed parent item."""
    from fanout.models import BatchRun
    from tests.testapp.models import Execution, Observation

    crashed = Observation.objects.filter(run_id__in=tree, name="chaos-spawn-exit")
    respawned = 0
    for child_id in crashed.values_list("run_id", flat=True):
        parent = BatchRun.objects.get(pk=child_id).parent_item
        if parent is None:
            continue
        n = Execution.objects.filter(run_id=parent.run_id, key=parent.key).count()
        respawned += n >= 2
        result.check(n >= 2, f"{parent.key} ran {n} times after its worker died spawning")
    return respawned


def _children_in_flight(tree: list[int]) -> dict[str, tuple[int, int]]:
    """Per parent level: the most child runs of one parent run alive at once, and its limit.

    A child run lives from its creation to its end, inside the time its parent item holds a
    slot of its run (claimed, then waiting), so no more than the parent's max_parallel overlap.
    """
    from fanout.models import BatchRun

    out: dict[str, tuple[int, int]] = {}
    parents = BatchRun.objects.filter(pk__in=tree, definition__in=LEVELS[:2])
    for parent in parents:
        spans = [
            (c.created_at.timestamp(), c.finished_at.timestamp())
            for c in BatchRun.objects.filter(parent_item__run_id=parent.pk)
            if c.finished_at is not None
        ]
        most, limit = out.get(parent.definition, (0, parent.max_parallel))
        out[parent.definition] = (max(most, max_overlap(spans)), limit)
    return {name: out[name] for name in LEVELS[:2] if name in out}
