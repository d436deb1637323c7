#!/usr/bin/env python
"""Benchmark of fanout on PostgreSQL and Redis: throughput, baseline, materialization, claim
cost and pool-limited runs, in one invocation (see bench/README.md).

    .venv/bin/python bench/run.py [--items N] [--repeats R] [--quick] [--json PATH]

It uses its own database (DATABASE_URL, default postgres://root@127.0.0.1:5432/fanout_bench,
created and migrated if missing) and its own Redis database (REDIS_URL, default
redis://127.0.0.1:6379/6): it empties both, so it refuses a database whose name lacks "bench"
and Redis database 0. RQ workers are started as subprocesses and always stopped.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
# Run as a script, Python puts bench/ first on the path; the repository root is what we want.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DATABASE_URL", "postgres://root@127.0.0.1:5432/fanout_bench")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/6")
os.environ.setdefault("FANOUT_BENCH_BATCH", "200")

TERMINAL = ("succeeded", "failed", "cancelled")

# ----------------------------------------------------------------------------- subprocesses

_children: list[subprocess.Popen] = []


def _stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the child's process group (it is its own session), SIGKILL it after ``grace``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _stop_all_children() -> None:
    for proc in list(_children):
        _stop_process(proc, grace=5.0)
        if proc in _children:
            _children.remove(proc)


def _on_signal(signum: int, frame: Any) -> None:
    # Unwind through every finally: so workers are stopped and tables left clean.
    raise SystemExit(128 + signum)


def _die_with_parent() -> None:
    """In the child: be sent SIGTERM if the benchmark dies without stopping us (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def spawn(cmd: list[str], log: Path | None = None, **kwargs: Any) -> subprocess.Popen:
    env = {**os.environ, **kwargs.pop("env", {})}
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            **kwargs,
        )
    finally:
        if log:
            out.close()
    _children.append(proc)
    return proc


class Workers:
    """``count`` rqworker processes on the fanout queue, stopped on exit whatever happens."""

    def __init__(self, count: int, logdir: Path) -> None:
        self.count = count
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []
        self.names: list[str] = []
        self.logs: list[Path] = []

    def __enter__(self) -> Workers:
        import django_rq
        from rq import Worker

        conn = django_rq.get_connection("fanout")
        try:
            for i in range(self.count):
                name = f"bench-{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}"
                log = self.logdir / f"{name}.log"
                cmd = [
                    sys.executable,
                    "manage.py",
                    "rqworker",
                    "fanout",
                    "--worker-class",
                    "fanout.rq.FanoutWorker",
                    "--name",
                    name,
                    "--max-idle-time",
                    "300",
                ]
                self.procs.append(spawn(cmd, log))
                self.names.append(name)
                self.logs.append(log)
            deadline = time.monotonic() + 60
            while True:
                self.check()
                alive = {w.name for w in Worker.all(connection=conn)}
                if set(self.names) <= alive:
                    return self
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rqworkers did not register within 60 s; logs: {self.logs}")
                time.sleep(0.1)
        except BaseException:
            self.__exit__()
            raise

    def check(self) -> None:
        for proc, log in zip(self.procs, self.logs, strict=True):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"rqworker exited with {proc.returncode}; log {log}:\n{tail}")

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Wait until no drain job is queued or running (the previous run's drains returned)."""
        import django_rq
        from rq.registry import StartedJobRegistry

        queue = django_rq.get_queue("fanout")
        started = StartedJobRegistry(queue=queue)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if queue.count == 0 and started.count == 0:
                return
            time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            _stop_process(proc)
            if proc in _children:
                _children.remove(proc)


# ---------------------------------------------------------------------------------- helpers


def stats(values: list[float]) -> dict[str, Any]:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": [round(v, 6) for v in values],
    }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Retry(Exception):
    """A measurement failed for a reason outside the code under test: run it again."""


def db_errors() -> tuple[type[BaseException], ...]:
    import psycopg
    from django.db import InterfaceError, OperationalError

    return (
        Retry,
        OperationalError,
        InterfaceError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )


def wait_for_database(timeout: float = 180.0) -> None:
    from django.db import connection

    deadline = time.monotonic() + timeout
    while True:
        try:
            with connection.cursor() as cur:
                cur.execute("SELECT 1")
            return
        except db_errors():
            connection.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def retry_db[T](what: str, fn: Callable[[], T], tries: int = 3) -> T:
    """Run one measurement; if the database went away (a shared server restarted by someone
    else), wait until it is back and measure again: the figure is then from a clean attempt."""
    from django.db import connection

    for attempt in range(1, tries + 1):
        try:
            return fn()
        except db_errors() as exc:
            connection.close()
            if attempt == tries:
                raise
            log(f"  {what}: the database went away ({str(exc).strip()[:160]}); measuring again")
            wait_for_database()
    raise AssertionError("unreachable")


def db_settings() -> dict[str, Any]:
    from django.conf import settings

    return settings.DATABASES["default"]


def conninfo(dbname: str | None = None) -> str:
    cfg = db_settings()
    parts = {
        "dbname": dbname or cfg["NAME"],
        "user": cfg.get("USER") or "",
        "password": cfg.get("PASSWORD") or "",
        "host": cfg.get("HOST") or "",
        "port": cfg.get("PORT") or "",
    }
    return " ".join(f"{k}='{v}'" for k, v in parts.items() if v)


def ensure_database() -> None:
    """Create the bench database if it is missing (before Django connects to it)."""
    import psycopg

    cfg = db_settings()
    if cfg["ENGINE"] != "django.db.backends.postgresql":
        raise SystemExit("the benchmark needs PostgreSQL: set DATABASE_URL=postgres://...")
    name = cfg["NAME"]
    if "bench" not in name:
        raise SystemExit(
            f"refusing to run against database {name!r}: the benchmark empties its tables; "
            "use a database whose name contains 'bench'"
        )
    with psycopg.connect(conninfo("postgres"), autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
            log(f"created database {name}")


def redis_conn() -> Any:
    import django_rq

    return django_rq.get_connection("fanout")


def reset_redis() -> None:
    conn = redis_conn()
    db = conn.connection_pool.connection_kwargs.get("db", 0)
    if not db:
        raise SystemExit("refusing to empty Redis database 0: set REDIS_URL=redis://host:port/N")
    conn.flushdb()


def reset_tables() -> None:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE fanout_itemclaim, fanout_batchrun, fanout_capacitypool RESTART IDENTITY"
        )


def analyze() -> None:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("ANALYZE fanout_itemclaim")
        cur.execute("ANALYZE fanout_batchrun")


def run_key(name: str) -> str:
    return f"{name}:{uuid.uuid4().hex}"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    info["loadavg_start"] = os.getloadavg()
    try:  # which code was measured
        git = ["git", "-C", str(ROOT)]
        info["git_commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        info["fanout_uncommitted_changes"] = bool(
            subprocess.run(
                [*git, "status", "--porcelain", "--untracked-files=no", "--", "fanout"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        from django.db import connection

        with connection.cursor() as cur:
            cur.execute("SHOW server_version")
            info["postgresql"] = cur.fetchone()[0]
            for setting in ("synchronous_commit", "shared_buffers", "fsync"):
                cur.execute(f"SHOW {setting}")
                info[f"pg_{setting}"] = cur.fetchone()[0]
        info["redis"] = redis_conn().info("server").get("redis_version")
        import django
        import psycopg
        import rq

        info["django"] = django.get_version()
        info["psycopg"] = psycopg.__version__
        info["rq"] = rq.__version__
    except Exception as exc:  # informational only
        info["error"] = str(exc)
    return info


# ------------------------------------------------------------------- 1. end-to-end throughput


def wait_run(run_id: int, timeout: float, workers: Workers | None = None) -> Any:
    from fanout.models import BatchRun

    deadline = time.monotonic() + timeout
    while True:
        run = BatchRun.objects.get(pk=run_id)
        if run.status in TERMINAL:
            return run
        if workers is not None:
            workers.check()
        if time.monotonic() > deadline:
            from fanout.recover import cancel_run

            cancel_run(run, "benchmark timed out")
            raise RuntimeError(f"run {run_id} did not finish within {timeout:.0f} s")
        time.sleep(0.01)


def one_run(name: str, n: int, executor: str, workers: int, pool: Workers | None) -> dict:
    """Start a run of ``n`` items and wait for its join; return timings from start to join."""
    from django.utils import timezone

    from fanout.definition import get_definition

    definition = get_definition(name)
    reset_tables()
    if pool is not None:
        pool.wait_idle()
    t0 = timezone.now()
    m0 = time.monotonic()
    run = definition.start(
        {"n": n}, run_key(name), executor=executor, workers=workers, wait=executor == "inline"
    )
    if executor == "rq":
        run = wait_run(run.pk, timeout=120 + n / 100, workers=pool)
        elapsed = (run.finished_at - t0).total_seconds()
    else:
        elapsed = time.monotonic() - m0
    ok = run.status == "succeeded" and run.join_result == n and run.join_runs == 1
    if not ok:
        raise RuntimeError(
            f"{name} via {executor}: run {run.pk} ended {run.status}, join_result "
            f"{run.join_result!r} (want {n}), join_runs {run.join_runs}: {run.error[:500]}"
        )
    materialize = (run.started_at - t0).total_seconds()
    return {
        "seconds": elapsed,
        "items_per_s": n / elapsed,
        "materialize_s": materialize,
        "drain_and_join_s": (run.finished_at - run.started_at).total_seconds(),
    }


def phase_throughput(cfg: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """No-op and 1 ms definitions through RQ (1 and 2 workers) and inline (1 and 2 threads);
    per-item-commit mode through RQ (its target compares it with the bare loop)."""
    cases = [
        ("noop", "bench.noop", cfg.items),
        ("sleep1ms", "bench.sleep1ms", cfg.sleep_items),
        ("per_item_commit", "bench.noop_each", cfg.each_items),
    ]
    inline_cases = cases[:2]
    out: dict[str, Any] = {}

    def measure(label: str, name: str, n: int, executor: str, workers: int, pool: Any) -> None:
        key = f"{label}/{executor}{workers}"
        samples = []
        for r in range(cfg.repeats):
            res = retry_db(key, lambda: one_run(name, n, executor, workers, pool))
            samples.append(res)
            log(
                f"  {key} #{r + 1}: {n} items in {res['seconds']:.2f} s = "
                f"{res['items_per_s']:,.0f}/s (materialize {res['materialize_s']:.2f} s)"
            )
        out[key] = {
            "definition": name,
            "items": n,
            "executor": executor,
            "workers": workers,
            "batch_size": 1 if label == "per_item_commit" else cfg.batch,
            "items_per_s": stats([s["items_per_s"] for s in samples]),
            "seconds": stats([s["seconds"] for s in samples]),
            "materialize_s": stats([s["materialize_s"] for s in samples]),
            "drain_and_join_s": stats([s["drain_and_join_s"] for s in samples]),
        }

    for count in (1, 2):
        log(f"throughput: RQ with {count} rqworker process(es)")
        with Workers(count, logdir) as pool:
            for label, name, n in cases:
                measure(label, name, n, "rq", count, pool)
    for threads in cfg.inline_workers:
        log(f"throughput: inline executor, {threads} thread(s)")
        for label, name, n in inline_cases:
            measure(label, name, n, "inline", threads, None)
    reset_tables()
    return out


# ---------------------------------------------------------------------- 2. bare claim loop

BARE_DDL = """
CREATE TABLE IF NOT EXISTS bench_bare (
    id bigserial PRIMARY KEY,
    run_id integer NOT NULL,
    key varchar(255) NOT NULL,
    index integer NOT NULL,
    payload jsonb,
    status varchar(16) NOT NULL DEFAULT 'pending',
    finished_at timestamptz,
    UNIQUE (run_id, key)
);
CREATE INDEX IF NOT EXISTS bench_bare_pending ON bench_bare (run_id, index)
    WHERE status = 'pending';
"""


def bare_fill(n: int) -> None:
    import psycopg

    with psycopg.connect(conninfo(), autocommit=True) as conn:
        conn.execute(BARE_DDL)
        conn.execute("TRUNCATE bench_bare")
        conn.execute(
            "INSERT INTO bench_bare (run_id, key, index, payload) "
            "SELECT 1, g::text, g, jsonb_build_object('n', g) FROM generate_series(0, %s) g",
            (n - 1,),
        )
        conn.execute("VACUUM ANALYZE bench_bare")


def bare_loop(batch: int) -> int:
    """Claim ``batch`` pending rows with SKIP LOCKED and mark them done, one transaction each."""
    import psycopg

    done = 0
    with psycopg.connect(conninfo(), autocommit=True) as conn:
        while True:
            with conn.transaction():
                rows = conn.execute(
                    "SELECT id, payload FROM bench_bare WHERE run_id = 1 AND status = 'pending' "
                    "ORDER BY index LIMIT %s FOR UPDATE SKIP LOCKED",
                    (batch,),
                ).fetchall()
                if not rows:
                    return done
                conn.execute(
                    "UPDATE bench_bare SET status = 'succeeded', finished_at = now() "
                    "WHERE id = ANY(%s)",
                    ([r[0] for r in rows],),
                )
            done += len(rows)


def bare_once(n: int, batch: int, conns: int) -> float:
    """Fill the bare table with ``n`` rows, drain it with ``conns`` loops; return the seconds."""
    bare_fill(n)
    counts: list[int] = []
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            counts.append(bare_loop(batch))
        except BaseException as exc:  # re-raised in the caller, where retry_db sees it
            errors.append(exc)

    threads = [threading.Thread(target=loop) for _ in range(conns)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    if errors:
        raise errors[0]
    if sum(counts) != n:
        raise RuntimeError(f"bare loop: {sum(counts)} rows done, want {n}")
    return elapsed


def phase_baseline(cfg: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = [
        ("bare_1_per_tx", 1, 1, cfg.items),
        ("bare_1_per_tx_2conn", 1, 2, cfg.items),
        ("bare_100_per_tx", 100, 1, cfg.items),
    ]
    for label, batch, conns, n in cases:
        samples = []
        for r in range(cfg.repeats):
            elapsed = retry_db(label, partial(bare_once, n, batch, conns))
            samples.append(n / elapsed)
            log(f"  {label} #{r + 1}: {n} rows in {elapsed:.2f} s = {n / elapsed:,.0f}/s")
        out[label] = {
            "items": n,
            "batch": batch,
            "connections": conns,
            "items_per_s": stats(samples),
        }
    import psycopg

    with psycopg.connect(conninfo(), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_bare")
    return out


# ----------------------------------------------------------------------- 3. materialization


def peak_rss_kb() -> int:
    """This process's peak RSS (VmHWM). ru_maxrss would carry over the forking parent's peak."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def child_materialize(n: int) -> None:
    """Subprocess: write a run of ``n`` items; print items/s and the process's peak RSS."""
    import django

    django.setup()
    from fanout.definition import get_definition
    from fanout.dispatch import prepare_run

    before = peak_rss_kb()
    t0 = time.perf_counter()
    run = prepare_run(get_definition("bench.materialize"), {"n": n}, run_key("materialize"))
    elapsed = time.perf_counter() - t0
    peak = peak_rss_kb()
    if run.total_items != n or run.status != "running":
        raise SystemExit(f"materialized {run.total_items} items ({run.status}), want {n}")
    print(
        json.dumps(
            {
                "items": n,
                "seconds": elapsed,
                "items_per_s": n / elapsed,
                "peak_rss_mb": peak / 1024,
                "rss_after_setup_mb": before / 1024,
            }
        )
    )


def materialize_once(n: int) -> dict[str, Any]:
    reset_tables()
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "run.py"), "--child-materialize", str(n)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    _children.append(proc)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        _stop_process(proc)
        _children.remove(proc)
    if proc.returncode != 0:
        message = f"materialize {n}: exit {proc.returncode}\n{stderr[-3000:]}"
        if "OperationalError" in stderr or "InterfaceError" in stderr:
            raise Retry(message)
        raise RuntimeError(message)
    return json.loads(stdout.strip().splitlines()[-1])


def phase_materialize(cfg: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in cfg.materialize_sizes:
        samples = []
        for r in range(cfg.repeats):
            res = retry_db(f"materialize {n:,}", partial(materialize_once, n))
            samples.append(res)
            log(
                f"  materialize {n:,} #{r + 1}: {res['items_per_s']:,.0f} items/s, peak RSS "
                f"{res['peak_rss_mb']:.0f} MB (after setup {res['rss_after_setup_mb']:.0f})"
            )
        out[str(n)] = {
            "items": n,
            "items_per_s": stats([s["items_per_s"] for s in samples]),
            "peak_rss_mb": stats([s["peak_rss_mb"] for s in samples]),
            "rss_after_setup_mb": stats([s["rss_after_setup_mb"] for s in samples]),
        }
    reset_tables()
    return out


# ------------------------------------------------------------------------------ 4. claim cost

FILLER_PER_RUN = 10_000


def add_terminal_rows(total: int) -> None:
    """Grow the terminal rows of other (finished) runs to ``total``, 10,000 per run."""
    from django.db import connection
    from django.utils import timezone

    from fanout.models import BatchRun, ItemClaim

    have = ItemClaim.objects.filter(run__definition="bench.filler").count()
    runs_needed = -(-(total - have) // FILLER_PER_RUN)
    if runs_needed <= 0:
        return
    now = timezone.now()
    runs = BatchRun.objects.bulk_create(
        [
            BatchRun(
                definition="bench.filler",
                run_key=run_key("filler"),
                params={},
                status="succeeded",
                max_parallel=4,
                failure_policy="collect",
                join_mode="all",
                total_items=FILLER_PER_RUN,
                materialized_upto=FILLER_PER_RUN,
                started_at=now,
                finished_at=now,
            )
            for _ in range(runs_needed)
        ]
    )
    with connection.cursor() as cur:
        for i in range(0, len(runs), 10):
            cur.execute(
                """
                INSERT INTO fanout_itemclaim (run_id, key, index, payload, pool, status, owner,
                    claimed_at, attempt, crashes, next_attempt_at, result, error, error_class,
                    started_at, finished_at)
                SELECT r, g::text, g, jsonb_build_object('n', g), '', 'succeeded', 'bench',
                    now(), 1, 0, now(), 'null'::jsonb, '', '', now(), now()
                FROM unnest(%s::bigint[]) r, generate_series(0, %s) g
                """,
                ([run.pk for run in runs[i : i + 10]], FILLER_PER_RUN - 1),
            )
    analyze()


def measure_claims(samples: int, warmup: int) -> list[float]:
    """Time ``samples`` claim transactions of one item each (recording each outside the timing)."""
    from fanout.claim import claim
    from fanout.definition import get_definition
    from fanout.dispatch import prepare_run
    from fanout.record import SUCCEEDED, ExecutionOutcome, record

    definition = get_definition("bench.noop_each")
    run = prepare_run(definition, {"n": samples + warmup}, run_key("claims"))
    times = []
    for i in range(samples + warmup):
        t0 = time.perf_counter()
        res = claim(run.pk, "bench-claimer", 1, 30.0, 3, None)
        dt = time.perf_counter() - t0
        if len(res.items) != 1:
            raise RuntimeError(f"claim {i} got {len(res.items)} items: {res.reason}")
        item = res.items[0]
        record(run.pk, res.token, [ExecutionOutcome(item.pk, item.key, SUCCEEDED)], "collect")
        if i >= warmup:
            times.append(dt)
    return times


def phase_claims(cfg: argparse.Namespace) -> dict[str, Any]:
    """Claim latency as the terminal rows of other runs grow, every level in every repeat.

    Each repeat starts from an empty table and grows it through the levels, so that the
    levels of one repeat are measured minutes apart at most: on a shared machine the load
    drifts, and comparing levels measured in separate stretches would measure the drift.
    """
    levels = sorted(cfg.claim_levels)
    medians: dict[int, list[float]] = {n: [] for n in levels}
    p99s: dict[int, list[float]] = {n: [] for n in levels}
    ratios: list[float] = []

    def one_repeat(r: int) -> dict[int, list[float]]:
        reset_tables()
        found: dict[int, list[float]] = {}
        for level in levels:
            t0 = time.monotonic()
            add_terminal_rows(level)
            filled = time.monotonic() - t0
            found[level] = times = measure_claims(cfg.claim_samples, warmup=20)
            log(
                f"  #{r + 1} {level:,} terminal rows (filled in {filled:.1f} s): median "
                f"{statistics.median(times) * 1000:.2f} ms, "
                f"p99 {percentile(times, 99) * 1000:.2f} ms ({len(times)} claims)"
            )
        return found

    for r in range(cfg.repeats):
        found = retry_db("claim cost", partial(one_repeat, r))
        for level, times in found.items():
            medians[level].append(statistics.median(times) * 1000)
            p99s[level].append(percentile(times, 99) * 1000)
        ratios.append(p99s[levels[-1]][-1] / p99s[levels[0]][-1])
    reset_tables()
    out: dict[str, Any] = {
        str(level): {
            "terminal_rows": level,
            "claims_per_repeat": cfg.claim_samples,
            "median_ms": stats(medians[level]),
            "p99_ms": stats(p99s[level]),
        }
        for level in levels
    }
    out["p99_ratio_largest_to_smallest"] = stats(ratios)
    return out


# ------------------------------------------------------------------------ 5. pool-limited runs


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals]
    events.sort(key=lambda ev: (ev[0], ev[1]))  # an end before a start at the same instant
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def rate_excess(times: list[float], rate: float, burst: int) -> tuple[float, int]:
    """Largest (admissions in [t_i, t_j]) - (burst + rate * (t_j - t_i)), and the largest count
    of admissions in any half-open one-second window."""
    times = sorted(times)
    worst = float("-inf")
    for i in range(len(times)):
        for j in range(i, len(times)):
            worst = max(worst, (j - i + 1) - (burst + rate * (times[j] - times[i])))
    window = 0
    lo = 0
    for hi in range(len(times)):
        while times[hi] - times[lo] >= 1.0:
            lo += 1
        window = max(window, hi - lo + 1)
    return worst, window


def pool_run(name: str, n: int, cfg: argparse.Namespace) -> tuple[Any, float]:
    from fanout.definition import get_definition

    reset_tables()  # also the pools: every repeat starts with a fresh pool row and full bucket
    t0 = time.monotonic()
    run = get_definition(name).start(
        {"n": n}, run_key(name), executor="inline", workers=cfg.pool_threads
    )
    return run, time.monotonic() - t0


def phase_pools(cfg: argparse.Namespace) -> dict[str, Any]:
    from django.conf import settings

    from bench.fanouts import POOL_SLEEP
    from fanout.models import ItemClaim
    from fanout.pools import parse_rate

    out: dict[str, Any] = {}
    conc = settings.FANOUT_POOLS["bench-conc4"]["max_concurrency"]
    rate_cfg = settings.FANOUT_POOLS["bench-rate50"]
    rate_count, rate_period = parse_rate(rate_cfg["rate"])
    rate = rate_count / rate_period
    burst = rate_cfg.get("burst") or rate_count

    # Concurrency 4, 50 ms handler: the limit is 4 / 0.05 = 80 items/s.
    limit = conc / POOL_SLEEP
    fractions, speeds, peaks = [], [], []
    for r in range(cfg.repeats):
        n = cfg.pool_conc_items
        run, elapsed = retry_db("pool concurrency", partial(pool_run, "bench.pool_conc4", n, cfg))
        if run.status != "succeeded" or run.join_result != n:
            raise RuntimeError(f"pool_conc4 run ended {run.status}: {run.error[:300]}")
        rows = list(
            ItemClaim.objects.filter(run=run).values_list("claimed_at", "finished_at", "result")
        )
        lease_side = max_overlap([(c.timestamp(), f.timestamp()) for c, f, _ in rows])
        handlers = max_overlap([(res[0], res[1]) for _, _, res in rows])
        speeds.append(n / elapsed)
        fractions.append(n / elapsed / limit)
        peaks.append(max(lease_side, handlers))
        log(
            f"  pool concurrency {conc} #{r + 1}: {n / elapsed:.1f} items/s = "
            f"{n / elapsed / limit:.1%} of {limit:.0f}/s; at most {handlers} handlers and "
            f"{lease_side} claims at once"
        )
    out["concurrency4_50ms"] = {
        "items": cfg.pool_conc_items,
        "threads": cfg.pool_threads,
        "limit": f"{conc} at once x {POOL_SLEEP * 1000:.0f} ms = {limit:.0f} items/s",
        "limit_items_per_s": limit,
        "items_per_s": stats(speeds),
        "fraction_of_limit": stats(fractions),
        "max_in_flight": max(peaks),
        "exceeded": max(peaks) > conc,
    }

    fractions, speeds, windows, excesses = [], [], [], []
    for r in range(cfg.repeats):
        n = cfg.pool_rate_items
        run, elapsed = retry_db("pool rate", partial(pool_run, "bench.pool_rate50", n, cfg))
        if run.status != "succeeded" or run.join_result != n:
            raise RuntimeError(f"pool_rate50 run ended {run.status}: {run.error[:300]}")
        admitted = [
            c.timestamp()
            for c in ItemClaim.objects.filter(run=run).values_list("claimed_at", flat=True)
        ]
        excess, window = rate_excess(admitted, rate, burst)
        # The fastest the limit allows: the burst at once, then one admission per 1/rate s.
        ideal = (n - burst) / rate
        speeds.append(n / elapsed)
        fractions.append(ideal / elapsed)
        windows.append(window)
        excesses.append(excess)
        log(
            f"  pool rate {rate:g}/s #{r + 1}: {n} items in {elapsed:.2f} s (ideal {ideal:.2f} s)"
            f" = {ideal / elapsed:.1%} of the limit; max {window} admissions in any 1 s"
        )
    out["rate50"] = {
        "items": cfg.pool_rate_items,
        "threads": cfg.pool_threads,
        "limit": f"{rate:g}/s, burst {burst}",
        "limit_items_per_s": rate,
        "burst": burst,
        "items_per_s": stats(speeds),
        "fraction_of_limit": stats(fractions),
        "max_admissions_in_1s": max(windows),
        "max_excess_over_bucket": max(excesses),
        # A token bucket admits at most burst + rate * T in any interval T (1e-6: clock rounding)
        "exceeded": max(excesses) > 1e-6,
    }
    reset_tables()
    return out


# ------------------------------------------------------------------------------ the report


def fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def fmt_span(s: dict, f: Callable[[float], str] = fmt_rate) -> str:
    if s.get("median") is None:
        return "-"
    return f"{f(s['min'])}–{f(s['max'])}"


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    t: list[dict[str, Any]] = []

    def add(name: str, value: Any, goal: str, met: bool | None) -> None:
        t.append({"target": name, "value": value, "goal": goal, "met": met})

    tp, base = res.get("throughput", {}), res.get("baseline", {})
    rq2 = tp.get("noop/rq2", {}).get("items_per_s", {}).get("median")
    add("RQ, 2 workers, no-op items/s", rq2, ">= 5,000", None if rq2 is None else rq2 >= 5000)
    bare1 = base.get("bare_1_per_tx", {}).get("items_per_s", {}).get("median")
    each = tp.get("per_item_commit/rq2", {}).get("items_per_s", {}).get("median")
    ratio = each / bare1 if each and bare1 else None
    add(
        "per-item commit (RQ, 2 workers) / bare loop 1 per tx",
        ratio,
        ">= 0.80",
        None if ratio is None else ratio >= 0.8,
    )
    # For reading the above: the same with one worker against one connection, and two against two.
    each1 = tp.get("per_item_commit/rq1", {}).get("items_per_s", {}).get("median")
    bare2 = base.get("bare_1_per_tx_2conn", {}).get("items_per_s", {}).get("median")
    if each1 and bare1:
        add(
            "  (info) per-item commit, RQ 1 worker / bare 1 per tx, 1 connection",
            each1 / bare1,
            "info",
            None,
        )
    if each and bare2:
        add(
            "  (info) per-item commit, RQ 2 workers / bare 1 per tx, 2 connections",
            each / bare2,
            "info",
            None,
        )
    mat = res.get("materialize", {})
    big = mat.get(str(max((int(k) for k in mat), default=0)), {})
    for size, m in mat.items():
        v = m["items_per_s"]["median"]
        add(f"materialization {int(size):,} items, items/s", v, ">= 50,000", v >= 50000)
    if big:
        rss = big["peak_rss_mb"]["max"]
        add(f"materialization {big['items']:,} items, peak RSS MB (max)", rss, "< 200", rss < 200)
    cl = {k: v for k, v in res.get("claims", {}).items() if k.isdigit()}
    if cl:
        lo, hi = cl[str(min(int(k) for k in cl))], cl[str(max(int(k) for k in cl))]
        # The median over repeats of each repeat's own ratio (levels measured side by side).
        r = res["claims"]["p99_ratio_largest_to_smallest"]["median"]
        add(
            f"claim p99 at {hi['terminal_rows']:,} / at {lo['terminal_rows']:,} terminal rows",
            r,
            "<= 2.0",
            r <= 2.0,
        )
    for key, p in res.get("pools", {}).items():
        f = p["fraction_of_limit"]["median"]
        add(f"pool {key}: fraction of the limit (median)", f, ">= 0.90", f >= 0.9)
        add(
            f"pool {key}: never above the limit",
            not p["exceeded"],
            "never above",
            not p["exceeded"],
        )
    return t


def print_report(res: dict[str, Any]) -> None:
    base = res.get("baseline", {})
    bare1 = base.get("bare_1_per_tx", {}).get("items_per_s", {}).get("median")
    bare100 = base.get("bare_100_per_tx", {}).get("items_per_s", {}).get("median")

    def ratio(v: float | None, b: float | None) -> str:
        return "-" if not v or not b else f"{v / b:.2f}"

    lines = []
    w = f"{'':<44}{'items':>9}{'items/s':>10}{'min–max':>18}{'÷bare1':>8}{'÷bare100':>9}"
    lines.append(
        "1-2. End-to-end throughput, start → join (median of "
        f"{res['config']['repeats']}), and the bare psycopg claim loop"
    )
    lines.append(w)
    rows = []
    for key, v in res.get("throughput", {}).items():
        label = key.split("/")[0]
        plural = "s" if v["workers"] > 1 else ""
        who = (
            f"RQ {v['workers']} worker{plural}"
            if v["executor"] == "rq"
            else f"inline {v['workers']} thread{plural}"
        )
        rows.append((f"{label} (batch {v['batch_size']}), {who}", v))
    for v in base.values():
        conn = f", {v['connections']} conns" if v["connections"] > 1 else ""
        rows.append((f"bare loop, {v['batch']}/tx{conn}", v))
    for label, v in rows:
        s = v["items_per_s"]
        lines.append(
            f"{label:<44}{v['items']:>9,}{fmt_rate(s['median']):>10}"
            f"{fmt_span(s):>18}{ratio(s['median'], bare1):>8}"
            f"{ratio(s['median'], bare100):>9}"
        )
    mat = res.get("materialize", {})
    if mat:
        lines.append("")
        lines.append("3. Materialization (separate process)")
        lines.append(
            f"{'items':>12}{'items/s':>10}{'min–max':>18}{'peak RSS MB':>13}"
            f"{'min–max':>12}{'after setup':>13}"
        )
        for v in mat.values():
            s, m = v["items_per_s"], v["peak_rss_mb"]
            lines.append(
                f"{v['items']:>12,}{fmt_rate(s['median']):>10}{fmt_span(s):>18}"
                f"{m['median']:>13.0f}{fmt_span(m, lambda x: f'{x:.0f}'):>12}"
                f"{v['rss_after_setup_mb']['median']:>13.0f}"
            )
    cl = res.get("claims", {})
    if cl:
        lines.append("")
        lines.append(
            "4. One claim transaction (fanout.claim.claim, 1 item) vs terminal rows "
            "of other runs, ms"
        )
        lines.append(f"{'terminal rows':>14}{'median':>9}{'min–max':>14}{'p99':>9}{'min–max':>14}")
        ms = lambda x: f"{x:.2f}"  # noqa: E731
        for v in cl.values():
            if "terminal_rows" not in v:
                continue
            lines.append(
                f"{v['terminal_rows']:>14,}{v['median_ms']['median']:>9.2f}"
                f"{fmt_span(v['median_ms'], ms):>14}{v['p99_ms']['median']:>9.2f}"
                f"{fmt_span(v['p99_ms'], ms):>14}"
            )
        ratio_stats = cl.get("p99_ratio_largest_to_smallest")
        if ratio_stats and ratio_stats["median"] is not None:
            lines.append(
                f"p99 at the largest / at the smallest level, per repeat: "
                f"{ratio_stats['median']:.2f} ({fmt_span(ratio_stats, ms)})"
            )
    pools = res.get("pools", {})
    if pools:
        lines.append("")
        lines.append("5. Pool-limited runs (inline executor)")
        for key, v in pools.items():
            s, f = v["items_per_s"], v["fraction_of_limit"]
            extra = (
                f"max in flight {v['max_in_flight']}"
                if "max_in_flight" in v
                else f"max {v['max_admissions_in_1s']} admissions in any 1 s (the bucket allows "
                f"{v['burst'] + v['limit_items_per_s']:g})"
            )
            lines.append(
                f"{key:<20} limit {v['limit']}: {s['median']:.1f} items/s "
                f"({fmt_span(s, lambda x: f'{x:.1f}')}), {f['median']:.1%} of the limit "
                f"({fmt_span(f, lambda x: f'{x:.1%}')}); {extra}; "
                f"{'EXCEEDED' if v['exceeded'] else 'never above'}"
            )
    lines.append("")
    lines.append("Targets")
    for t in res.get("targets", []):
        v = t["value"]
        shown = (
            f"{v:,.2f}"
            if isinstance(v, float) and v < 100
            else f"{v:,.0f}"
            if isinstance(v, float)
            else str(v)
        )
        met = (
            ("" if t["goal"] == "info" else "n/a")
            if t["met"] is None
            else ("met" if t["met"] else "NOT MET")
        )
        goal = "" if t["goal"] == "info" else f"  ({t['goal']}): {met}"
        lines.append(f"  {t['target']:<66}{shown:>10}{goal}")
    for e in res.get("errors", []):
        lines.append(f"ERROR in {e['phase']}: {e['error']}")
    lines.append(f"total {res['seconds']:.0f} s")
    print("\n".join(lines))


# ------------------------------------------------------------------------------------- main

PHASES = ("throughput", "baseline", "materialize", "claims", "pools")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--items",
        type=int,
        default=None,
        help="items of the no-op runs and the bare loop (default 20,000; quick 2,000)",
    )
    p.add_argument("--repeats", type=int, default=None, help="repeats per figure (default 3)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 repeat, small sizes: a smoke test, not a measurement",
    )
    p.add_argument("--json", default=str(HERE / "results" / "latest.json"), metavar="PATH")
    p.add_argument(
        "--only",
        default=",".join(PHASES),
        help=f"comma-separated phases to run, of {', '.join(PHASES)}",
    )
    p.add_argument(
        "--materialize",
        metavar="N,N",
        default=None,
        help="materialization sizes (default 100000,1000000; quick 10000,100000)",
    )
    p.add_argument(
        "--claim-levels",
        metavar="N,N,N",
        default=None,
        help="terminal rows for the claim cost (default 10000,100000,1000000)",
    )
    p.add_argument("--child-materialize", type=int, help=argparse.SUPPRESS)
    cfg = p.parse_args(argv)
    quick = cfg.quick
    cfg.repeats = cfg.repeats or (1 if quick else 3)
    cfg.items = cfg.items or (2_000 if quick else 20_000)
    # The 1 ms and per-item-commit runs are slower per item: fewer items are enough.
    cfg.sleep_items = max(100, cfg.items // 4)
    cfg.each_items = max(100, cfg.items // 10)
    cfg.batch = int(os.environ["FANOUT_BENCH_BATCH"])
    cfg.inline_workers = [1, 2]
    sizes = lambda text: [int(x.replace("_", "")) for x in text.split(",") if x.strip()]  # noqa: E731
    cfg.materialize_sizes = (
        sizes(cfg.materialize)
        if cfg.materialize
        else ([10_000, 100_000] if quick else [100_000, 1_000_000])
    )
    cfg.claim_levels = (
        sizes(cfg.claim_levels)
        if cfg.claim_levels
        else ([10_000, 100_000] if quick else [10_000, 100_000, 1_000_000])
    )
    cfg.claim_samples = 200 if quick else 500
    cfg.pool_threads = 8
    cfg.pool_conc_items = 80 if quick else 400
    cfg.pool_rate_items = 100 if quick else 300
    cfg.phases = [x.strip() for x in cfg.only.split(",") if x.strip()]
    unknown = set(cfg.phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases: {', '.join(sorted(unknown))}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.child_materialize:
        child_materialize(cfg.child_materialize)
        return 0
    signal.signal(signal.SIGTERM, _on_signal)
    atexit.register(_stop_all_children)

    import django
    from django.conf import settings

    settings.DATABASES  # noqa: B018  (load the settings to read the database)
    ensure_database()
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    reset_redis()
    reset_tables()
    logdir = Path(tempfile.mkdtemp(prefix="fanout-bench-"))
    started = time.monotonic()
    res: dict[str, Any] = {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            k: v
            for k, v in vars(cfg).items()
            if k not in ("json", "only", "child_materialize", "materialize")
        },
        "loadavg": {},
        "errors": [],
    }
    steps = {
        "throughput": lambda: phase_throughput(cfg, logdir),
        "baseline": lambda: phase_baseline(cfg),
        "materialize": lambda: phase_materialize(cfg),
        "claims": lambda: phase_claims(cfg),
        "pools": lambda: phase_pools(cfg),
    }
    try:
        for phase in PHASES:
            if phase not in cfg.phases:
                continue
            log(f"phase: {phase} (load average {os.getloadavg()[0]:.2f})")
            load_before = os.getloadavg()
            try:
                res[phase] = steps[phase]()
                res["loadavg"][phase] = {"before": load_before, "after": os.getloadavg()}
            except (Exception, KeyboardInterrupt) as exc:
                res["errors"].append({"phase": phase, "error": f"{type(exc).__name__}: {exc}"})
                log(f"phase {phase} failed: {type(exc).__name__}: {exc}")
                if isinstance(exc, KeyboardInterrupt):
                    break
                _stop_all_children()
                from django.db import connection

                connection.close()  # the next phase reconnects, should the server have restarted
    finally:
        _stop_all_children()
        try:
            from django.db import connection

            connection.close()
            wait_for_database(timeout=30)
            reset_tables()
            reset_redis()
        except Exception as exc:  # the report still gets written
            log(f"cleanup failed: {exc}")
    res["seconds"] = time.monotonic() - started
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["targets"] = targets(res)
    path = Path(cfg.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print_report(res)
    print(f"\nJSON written to {path}; worker logs in {logdir}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
