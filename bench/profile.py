#!/usr/bin/env python
"""Where a batched run's time goes: one run of the no-op definition in batches (bench.noop)
through RQ workers started as bench/run.py starts them, sampled by py-spy in every worker and
counted by PostgreSQL's pg_stat_statements (see bench/README.md, "Where the time goes").

    .venv/bin/python bench/profile.py [--items 20000] [--workers 2] [--no-py-spy] [--top 25]

Same databases and rules as bench/run.py (DATABASE_URL, REDIS_URL; names without "bench"
refused). pg_stat_statements is read when the server has it loaded (shared_preload_libraries)
and the extension can be created; py-spy when it is installed (the dev extra). Either missing
is said and skipped.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import run as bench  # noqa: E402  (sets the settings module and the path first)


def statements_ready() -> bool:
    """Reset pg_stat_statements; False when the server does not have it."""
    from django.db import connection

    try:
        with connection.cursor() as cursor:
            cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            cursor.execute("SELECT pg_stat_statements_reset()")
        return True
    except Exception as exc:  # not preloaded, or no right to create it
        bench.log(f"pg_stat_statements unavailable ({str(exc).strip()[:120]}): skipped")
        connection.close()
        return False


def statements(n: int, top: int) -> list[str]:
    """The bench database's statements by total execution time, per item of the run."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT calls, total_exec_time, rows,"
            " left(regexp_replace(query, '\\s+', ' ', 'g'), 110)"
            " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
            " WHERE d.datname = current_database() ORDER BY total_exec_time DESC"
        )
        rows = cursor.fetchall()
    total = sum(r[1] for r in rows) or 1.0
    lines = [
        f"pg_stat_statements: {total:,.0f} ms of execution in all, {total / n * 1000:.1f} µs "
        "per item",
        f"{'calls':>8}{'ms':>9}{'share':>7}{'µs/item':>9}{'rows':>9}  statement",
    ]
    for calls, ms, nrows, query in rows[:top]:
        lines.append(
            f"{calls:>8,}{ms:>9,.0f}{ms / total:>7.1%}{ms / n * 1000:>9.1f}{nrows:>9,}  {query}"
        )
    return lines


def spy(pids: list[int], outdir: Path) -> list[tuple[subprocess.Popen, Path]]:
    """Start py-spy on every worker (sampling without pausing it); [] without py-spy."""
    exe = Path(sys.executable).with_name("py-spy")
    if not exe.exists():
        bench.log("py-spy not installed (pip install -e '.[dev]'): skipped")
        return []
    out = []
    for pid in pids:
        path = outdir / f"{pid}.txt"
        cmd = [str(exe), "record", "--pid", str(pid), "--subprocesses", "--nonblocking"]
        cmd += ["--rate", "250", "--format", "raw", "--output", str(path)]
        out.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL), path))
    return out


def stacks(paths: list[Path]) -> Counter[tuple[str, ...]]:
    """py-spy's raw output (collapsed stacks, "frame;frame;... count"), every file together."""
    found: Counter[tuple[str, ...]] = Counter()
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            frames, _, count = line.rpartition(" ")
            if frames and count.isdigit():
                found[tuple(frames.split(";"))] += int(count)
    return found


def name(frame: str) -> str:
    """'execute (fanout/call.py:52)' -> 'execute (fanout/call.py)': one function, any line."""
    head, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for cut in ("site-packages/", "/lib/python3"):
        if cut in path:
            path = path.split(cut, 1)[1]
    return f"{head} ({path.replace(str(bench.ROOT) + '/', '')})"


def report_stacks(found: Counter[tuple[str, ...]], top: int) -> list[str]:
    """Samples in the drain threads: each function's own samples and those under it."""
    drain = {k: v for k, v in found.items() if any("_loop (" in f and "worker.py" in f for f in k)}
    total = sum(drain.values()) or 1
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    for frames, count in drain.items():
        names = [name(f) for f in frames]
        own[names[-1]] += count
        for fn in set(names):
            under[fn] += count
    lines = [f"py-spy: {total:,} samples in the drain loops (250 a second per thread)"]
    lines.append(f"{'inclusive':>10}{'own':>7}  function")
    for fn, count in under.most_common(top):
        lines.append(f"{count / total:>10.1%}{own[fn] / total:>7.1%}  {fn}")
    lines.append("own time, top functions:")
    for fn, count in own.most_common(top):
        lines.append(f"{count / total:>10.1%}  {fn}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-py-spy", action="store_true")
    cfg = p.parse_args(argv)
    signal.signal(signal.SIGTERM, bench._on_signal)
    import django

    bench.ensure_database()
    django.setup()
    bench.migrate()
    bench.reset_redis()
    bench.reset_tables()
    logdir = Path(tempfile.mkdtemp(prefix="fanout-profile-"))
    try:
        with bench.Workers(cfg.workers, logdir) as pool:
            bench.warm_up(pool)
            bench.reset_tables()
            counted = statements_ready()
            spies = [] if cfg.no_py_spy else spy(pool.pids(), logdir)
            try:
                res: dict[str, Any] = bench.one_run("bench.noop", cfg.items, "rq", None, pool)
            finally:
                for proc, _ in spies:
                    proc.send_signal(signal.SIGINT)
                for proc, _ in spies:
                    proc.wait(30)
        cpu = bench.server_cpu_field()
        print(
            f"bench.noop, {cfg.items:,} items in batches of {os.environ['FANOUT_BENCH_BATCH']}, "
            f"RQ {cfg.workers} workers: {res['items_per_s']:,.0f} items/s; CPU per item "
            f"{res['cpu_ms_per_item']:.3f} ms in the workers, {res[cpu]:.3f} ms in the database"
        )
        if counted:
            print("\n".join(statements(cfg.items, cfg.top)))
        if spies:
            print("\n".join(report_stacks(stacks([path for _, path in spies]), cfg.top)))
    finally:
        bench._stop_all_children()
        bench.reset_tables()
    print(f"worker logs and py-spy output in {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
