"""``python -m chaos``: run the chaos scenarios and print one line of figures per scenario."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from .badinput import bad_handlers, bad_input
from .compensation import compensate_killed, compensation
from .compete import competing_parents
from .crash import crash_parent, crash_workers
from .deploy import deploy
from .harness import DEFAULT_DATABASE_URL, Harness, Options, Result
from .infra import pg_restart, redis_flush, redis_stop
from .nested import nested
from .pool import exhausted_pool
from .writing import pg_restart_writing, writer_killed

# In the order they run; the PostgreSQL restarts, which every client of the server sees, last.
SCENARIOS: dict[str, Callable[[Harness, Result], None]] = {
    "compete": competing_parents,
    "crash-workers": crash_workers,
    "crash-parent": crash_parent,
    "deploy": deploy,
    "nested": nested,
    "compensation": compensation,
    "writer-killed": writer_killed,
    "compensate-killed": compensate_killed,
    "pool": exhausted_pool,
    "bad-handlers": bad_handlers,
    "bad-input": bad_input,
    "redis-flush": redis_flush,
    "redis-stop": redis_stop,
    "pg-restart": pg_restart,
    "pg-restart-writing": pg_restart_writing,
}


def parse_args(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m chaos",
        description="Run fanout's chaos scenarios against real PostgreSQL, Redis and workers.",
    )
    parser.add_argument(
        "--items",
        type=int,
        default=None,
        help="Items of the largest run, the worker crashes; the other long runs are sized "
        "from it. Default: 2000 (400 with --quick).",
    )
    parser.add_argument(
        "--quick", action="store_true", help="Fewer items everywhere (about two minutes)."
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help=f"Run only this scenario (repeatable): {', '.join(SCENARIOS)}. Default: all.",
    )
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    parser.add_argument(
        "--database-url",
        default=DEFAULT_DATABASE_URL,
        help=f"PostgreSQL database of the harness, created if missing. "
        f"Default: {DEFAULT_DATABASE_URL}.",
    )
    parser.add_argument(
        "--pg-fault",
        choices=("restart", "terminate"),
        default="restart",
        help="pg-restart restarts the server (pg_ctlcluster), or terminates only this "
        "database's sessions and refuses new ones for 3 s. Default: restart.",
    )
    parser.add_argument("--workers", type=int, default=8, help="RQ worker processes. Default: 8.")
    parser.add_argument(
        "--drop-database", action="store_true", help="Drop the database at the end."
    )
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="Keep the children's logs even when every scenario passed. Default: kept on failure.",
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.only if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    return Options(
        items=args.items,
        quick=args.quick,
        only=args.only,
        json=args.json,
        database_url=args.database_url,
        pg_fault=args.pg_fault,
        workers=args.workers,
        drop_database=args.drop_database,
        keep_logs=args.keep_logs,
    )


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    h = Harness(opts)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: list[Result] = []
    started = time.monotonic()
    try:
        h.setup()
        for name, scenario in SCENARIOS.items():
            if opts.only and name not in opts.only:
                continue
            result = Result(name)
            begun = time.monotonic()
            try:
                assert h.workers is not None
                h.workers.wait_ready(h.redis, since=h.redis_reset_at)
                h.begin()
                scenario(h, result)
                h.counter_drift(result)
                deadlocks = h.deadlocks()
                result.figures["deadlocks"] = deadlocks
                result.check(deadlocks == 0, f"{deadlocks} deadlocks between fanout transactions")
            except Exception as exc:
                result.check(False, f"the scenario broke: {type(exc).__name__}: {exc}")
                result.details["traceback"] = traceback.format_exc()
            finally:
                h.end()
            result.seconds = time.monotonic() - begun
            results.append(result)
            print(result.line(), flush=True)
    finally:
        h.teardown()
    passed = sum(r.passed for r in results)
    failed = len(results) - passed
    logs = str(h.logs) if failed or opts.keep_logs or not results else None
    if logs is None:
        shutil.rmtree(h.logs, ignore_errors=True)
    if opts.json is not None:
        opts.json.write_text(
            json.dumps(
                {
                    "passed": passed,
                    "failed": failed,
                    "seconds": round(time.monotonic() - started, 1),
                    "logs": logs,
                    "scenarios": [r.as_dict() for r in results],
                },
                indent=2,
                default=str,
            )
        )
    if logs is not None:
        print(f"logs: {logs}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
