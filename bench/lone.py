#!/usr/bin/env python
"""Hand-overs alone and in company: threads of one process hand over no-op items one after
another (record the outcome, take the next item, one commit each) one by one (FANOUT_GROUP_COMMIT
off) and grouped with 1, 2, ... statements in flight, the modes alternating round by round in
one invocation so that the machine's drift touches them alike.

    .venv/bin/python bench/lone.py [--threads 1,8] [--lanes 1,2] [--items N] [--rounds R]

Uses bench/run.py's database (DATABASE_URL; run bench/run.py once first to create and migrate
it). Prints, per thread count and mode, items/s and the median and p99 of one hand-over (with
one thread: the latency of a lone item at low load), the CPU its PostgreSQL backends used per
item, and each mode's items/s over one by one's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DATABASE_URL", "postgres://root@127.0.0.1:5432/fanout_bench")


def backend_cpu(pid: int) -> float:
    """CPU seconds a PostgreSQL backend has used (this host's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(items: int, threads: int) -> tuple[float, list[float], float]:
    """Wall seconds for ``threads`` threads to hand over a fresh run of ``items`` no-op items,
    the seconds of each hand-over, and the CPU seconds their PostgreSQL backends used."""
    from django.db import connection

    from fanout.claim import claim
    from fanout.definition import get_definition
    from fanout.dispatch import prepare_run
    from fanout.group_commit import shared_hand_over
    from fanout.transitions import SUCCEEDED, ExecutionOutcome

    definition = get_definition("bench.noop_each")
    run = prepare_run(definition, {"n": items}, f"lone-{uuid.uuid4().hex[:8]}")
    took: list[float] = []
    used: list[float] = []
    start = threading.Barrier(threads + 1)

    def drain(n: int) -> None:
        owner = f"lone:1:{n}"
        try:
            taken = claim(run.pk, owner, 1, 30, 3, None)
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid = cursor.fetchone()[0]
            cpu = backend_cpu(pid)
            start.wait()
            token, item = taken.token, taken.items[0] if taken.items else None
            mine = []
            while item is not None:
                new_token = uuid.uuid4()
                outcome = ExecutionOutcome(item.pk, item.key, SUCCEEDED, result=None)
                began = time.perf_counter()
                handed = shared_hand_over(run.pk, token, outcome, owner, new_token, 30)
                mine.append(time.perf_counter() - began)
                token, item = new_token, handed.next
            took.extend(mine)
            used.append(backend_cpu(pid) - cpu)
        finally:
            connection.close()

    workers = [threading.Thread(target=drain, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    began = time.perf_counter()
    for w in workers:
        w.join()
    return time.perf_counter() - began, took, sum(used)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--threads", default="1,8", help="thread counts, comma-separated (1,8)")
    p.add_argument("--lanes", default="1,2", help="statements in flight, grouped (1,2)")
    p.add_argument("--items", type=int, default=1000, help="items per round (default 1000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode (default 3)")
    args = p.parse_args()
    import django

    django.setup()
    from django.test.utils import override_settings

    modes = {"one by one": (False, 1)}
    for lanes in args.lanes.split(","):
        modes[f"grouped, {lanes} in flight"] = (True, int(lanes))
    for threads in [int(t) for t in args.threads.split(",")]:
        seen: dict[str, tuple[list[float], list[float], list[float]]] = {
            m: ([], [], []) for m in modes
        }
        for _ in range(args.rounds):
            for mode, (grouped, lanes) in modes.items():
                with override_settings(
                    FANOUT_GROUP_COMMIT=grouped, FANOUT_GROUP_COMMIT_LANES=lanes
                ):
                    wall, took, cpu = one_round(args.items, threads)
                seen[mode][0].append(args.items / wall)
                seen[mode][1].extend(took)
                seen[mode][2].append(cpu * 1000 / args.items)
        base = statistics.median(seen["one by one"][0])
        print(f"{threads} thread(s), {args.items} items x {args.rounds} rounds:")
        for mode, (rates, took, cpu) in seen.items():
            ms = sorted(t * 1000 for t in took)
            rate = statistics.median(rates)
            print(
                f"  {mode:>21}: {rate:7,.0f} items/s ({rate / base:.2f}x), hand-over median "
                f"{statistics.median(ms):.3f} ms, p99 {ms[int(len(ms) * 0.99)]:.3f} ms, "
                f"PostgreSQL CPU {statistics.median(cpu):.3f} ms/item"
            )


if __name__ == "__main__":
    main()
