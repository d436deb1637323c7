#!/usr/bin/env python
"""Latency of a lone worker thread at low load: one thread hands over one no-op item after
another (record the outcome, take the next item, one commit), with hand-overs grouped
(FANOUT_GROUP_COMMIT on) and one by one, alternating rounds in one invocation.

    .venv/bin/python bench/lone.py [--items N] [--rounds R]

Uses bench/run.py's database (DATABASE_URL, migrated by bench/run.py first); prints the median
and p99 of one hand-over in ms for each mode, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DATABASE_URL", "postgres://root@127.0.0.1:5432/fanout_bench")


def one_round(items: int, grouped: bool) -> list[float]:
    """Seconds of each hand-over of a fresh run of ``items`` no-op items, one thread."""
    from django.test.utils import override_settings

    from fanout.claim import claim
    from fanout.definition import get_definition
    from fanout.dispatch import prepare_run
    from fanout.group_commit import shared_hand_over
    from fanout.transitions import SUCCEEDED, ExecutionOutcome

    definition = get_definition("bench.noop_each")
    run = prepare_run(definition, {"n": items}, f"lone-{uuid.uuid4().hex[:8]}")
    owner = "lone:1:thread"
    taken = claim(run.pk, owner, 1, 30, 3, None)
    token, item = taken.token, taken.items[0]
    took = []
    with override_settings(FANOUT_GROUP_COMMIT=grouped):
        while item is not None:
            new_token = uuid.uuid4()
            outcome = ExecutionOutcome(item.pk, item.key, SUCCEEDED, result=None)
            began = time.perf_counter()
            handed = shared_hand_over(run.pk, token, outcome, owner, new_token, 30)
            took.append(time.perf_counter() - began)
            assert handed.written
            token, item = new_token, handed.next
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=500, help="items per round (default 500)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode (default 3)")
    args = p.parse_args()
    import django

    django.setup()
    seen: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for grouped in (False, True):
            seen[grouped] += one_round(args.items, grouped)
    figures = {}
    for grouped, took in seen.items():
        ms = sorted(t * 1000 for t in took)
        figures[grouped] = statistics.median(ms)
        name = "grouped" if grouped else "one by one"
        print(
            f"{name:>11}: {len(ms)} hand-overs, median {statistics.median(ms):.3f} ms, "
            f"p99 {ms[int(len(ms) * 0.99)]:.3f} ms"
        )
    print(f"median grouped / one by one: {figures[True] / figures[False]:.2f}")


if __name__ == "__main__":
    main()
