#!/usr/bin/env python
"""Benchmark of fanout on PostgreSQL and Redis: per-item commit against a bare psycopg loop,
batched throughput, materialization, claim cost and pool-limited runs, in one invocation (see
bench/README.md); then the same phases on MariaDB, printed beside.

    .venv/bin/python bench/run.py [--items N] [--repeats R] [--quick] [--json PATH]
                                  [--no-mariadb] [--mariadb-url URL] [--database mariadb]

It uses its own database (DATABASE_URL, default postgres://root@127.0.0.1:5432/fanout_bench,
created and migrated if missing) and its own Redis database (REDIS_URL, default
redis://127.0.0.1:6379/6): it empties both, so it refuses a database whose name lacks "bench"
and Redis database 0. RQ workers are started as subprocesses and always stopped.

The MariaDB pass is this script run again (--database mariadb) on MARIADB_URL, default
mysql://root@127.0.0.1:3306/fanout_bench, under the same rules; its JSON lands under "mariadb".
It is skipped, with a warning, when MySQLdb does not import or the server does not answer.
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
MARIADB_URL = os.environ.get("MARIADB_URL") or "mysql://root@127.0.0.1:3306/fanout_bench"

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
    """``count`` rqworker processes on the fanout queue, stopped on exit whatever happens.

    Started as users start them, ``manage.py rqworker fanout``: the worker class (FanoutWorker)
    and FANOUT_WORKER_THREADS come from the settings (bench.settings = the project's).
    """

    def __init__(self, count: int, logdir: Path, env: dict[str, str] | None = None) -> None:
        self.count = count
        self.logdir = logdir
        self.env = env or {}
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
                    "--name",
                    name,
                    "--max-idle-time",
                    "300",
                ]
                self.procs.append(spawn(cmd, log, env=self.env))
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

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def pause(self) -> None:
        """SIGSTOP the workers (each is its own process group), e.g. while runs are written
        that must reach them together."""
        for proc in self.procs:
            os.killpg(proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for proc in self.procs:
            os.killpg(proc.pid, signal.SIGCONT)

    def check(self) -> None:
        """Raise if a worker died or a drain job failed: a failed drain frees its slot only
        when its key expires, and the run would then sit until the benchmark's timeout."""
        for proc, log in zip(self.procs, self.logs, strict=True):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"rqworker exited with {proc.returncode}; log {log}:\n{tail}")
        import django_rq
        from rq.registry import FailedJobRegistry

        from fanout.queues import cleaned_up_by_rq

        failed = FailedJobRegistry(queue=django_rq.get_queue("fanout"))
        ids = failed.get_job_ids()
        errors = []
        for job_id in ids:
            job = failed.get_queue().fetch_job(job_id)
            exc = (job.latest_result().exc_string if job and job.latest_result() else "") or ""
            # A job a stopped worker left behind, failed by RQ's maintenance: the supervisor
            # fills its slot again; only a drain that failed by itself is an error.
            if not cleaned_up_by_rq(exc):
                errors.append(exc)
        if ids:
            failed.connection.delete(failed.key)  # reported once; the next run starts clean
        if errors:
            raise RuntimeError(f"{len(errors)} drain job(s) failed; the last: {errors[-1][-1500:]}")

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
        log(f"  drain jobs of an earlier run still queued or running after {timeout:.0f} s")

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
    # The MariaDB pass's lines say so: they are interleaved with the main invocation's.
    prefix = os.environ.get("FANOUT_BENCH_LOG_PREFIX", "")
    print(f"[{time.strftime('%H:%M:%S')}] {prefix}{msg}", file=sys.stderr, flush=True)


class Retry(Exception):
    """A measurement failed for a reason outside the code under test: run it again."""


def db_errors() -> tuple[type[BaseException], ...]:
    from django.db import InterfaceError, OperationalError

    errors: list[type[BaseException]] = [Retry, OperationalError, InterfaceError]
    # The bare loops speak the driver directly; either driver may be missing.
    for driver in ("psycopg", "MySQLdb"):
        try:
            module = __import__(driver)
        except ImportError:
            continue
        errors += [module.OperationalError, module.InterfaceError]
    return tuple(errors)


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


def is_mariadb() -> bool:
    return db_settings()["ENGINE"] == "django.db.backends.mysql"


def server_name() -> str:
    return "MariaDB" if is_mariadb() else "PostgreSQL"


def server_cpu_field() -> str:
    return "mariadb_cpu_ms_per_item" if is_mariadb() else "postgres_cpu_ms_per_item"


def cpu_fields() -> tuple[str, ...]:
    return ("cpu_ms_per_item", server_cpu_field(), "our_cores", "busy_cores")


def mysql_connect(cfg: dict[str, Any] | None = None, dbname: str | None = None) -> Any:
    """A MySQLdb connection from Django-style settings (default: the bench database's)."""
    import MySQLdb

    cfg = cfg or db_settings()
    kwargs: dict[str, Any] = {
        "host": cfg.get("HOST") or "127.0.0.1",
        "port": int(cfg.get("PORT") or 3306),
        "user": cfg.get("USER") or "root",
        "password": cfg.get("PASSWORD") or "",
        "charset": "utf8mb4",
        "connect_timeout": 5,
    }
    if dbname:
        kwargs["database"] = dbname
    return MySQLdb.connect(**kwargs)


def refuse_unless_bench(name: str) -> None:
    if "bench" not in name:
        raise SystemExit(
            f"refusing to run against database {name!r}: the benchmark empties its tables; "
            "use a database whose name contains 'bench'"
        )


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


def ensure_database(recreate: bool = False) -> None:
    """Create the bench database if it is missing (before Django connects to it), or afresh."""
    cfg = db_settings()
    if is_mariadb():
        ensure_mariadb_database(cfg, recreate)
        return
    if cfg["ENGINE"] != "django.db.backends.postgresql":
        raise SystemExit(
            "the benchmark needs PostgreSQL or MariaDB: set DATABASE_URL=postgres://... "
            "or mysql://..."
        )
    import psycopg

    name = cfg["NAME"]
    refuse_unless_bench(name)
    with psycopg.connect(conninfo("postgres"), autocommit=True) as conn:
        if recreate:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
            log(f"created database {name}")


def ensure_mariadb_database(cfg: dict[str, Any], recreate: bool) -> None:
    name = cfg["NAME"]
    refuse_unless_bench(name)
    if not name.replace("_", "").isalnum():  # it is spliced into the statements below
        raise SystemExit(f"refusing database name {name!r}: use letters, digits and _")
    conn = mysql_connect(cfg)
    try:
        cur = conn.cursor()
        if recreate:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        if not cur.execute("SHOW DATABASES LIKE %s", (name,)):
            cur.execute(f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4")
            log(f"created database {name}")
    finally:
        conn.close()


def mariadb_unavailable(url: str) -> str | None:
    """Why the MariaDB pass cannot run (no driver, no server), or None if it can."""
    import dj_database_url

    try:
        import MySQLdb  # noqa: F401
    except ImportError as exc:
        return f"the mysql driver does not import ({exc}; install the mysql extra)"
    cfg = dj_database_url.parse(url)
    if cfg["ENGINE"] != "django.db.backends.mysql":
        return "its URL is no mysql:// URL"  # not shown: it may hold a password
    try:
        mysql_connect(cfg).close()
    except Exception as exc:
        return f"the server at {cfg.get('HOST')}:{cfg.get('PORT')} does not answer: {exc}"
    return None


def migrate() -> None:
    """Migrate the bench database; if its history no longer matches fanout's migrations (one
    was renamed or rewritten while fanout is being developed), start it afresh: it holds only
    what the benchmark writes."""
    from django.core.management import call_command
    from django.db import DatabaseError, connection
    from django.db.migrations.exceptions import InconsistentMigrationHistory

    try:
        call_command("migrate", verbosity=0)
    except (DatabaseError, InconsistentMigrationHistory) as exc:
        log(f"migrate failed ({str(exc).strip()[:200]}); recreating the bench database")
        connection.close()
        ensure_database(recreate=True)
        call_command("migrate", verbosity=0)


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

    if is_mariadb():
        reset_mariadb_tables()
        return
    with connection.cursor() as cur:
        # Every table of fanout's, read from the database: a migration may add one mid-run.
        cur.execute(
            "SELECT quote_ident(tablename) FROM pg_tables "
            "WHERE schemaname = current_schema() AND tablename LIKE 'fanout\\_%'"
        )
        tables = ", ".join(row[0] for row in cur.fetchall())
        # Ids keep counting up: a worker process must never meet a new run under an old id.
        cur.execute(f"TRUNCATE {tables}")


def reset_mariadb_tables() -> None:
    """TRUNCATE every fanout table (DELETE of a million rows takes minutes), then set each
    AUTO_INCREMENT back to where it was: MariaDB's TRUNCATE restarts ids, and ids must keep
    counting up, as on PostgreSQL."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT table_name, auto_increment FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name LIKE 'fanout\\_%'"
        )
        tables = cur.fetchall()
        # A worker's open transaction would hold TRUNCATE forever (the default is a year).
        cur.execute("SET SESSION lock_wait_timeout = 60, SESSION foreign_key_checks = 0")
        try:
            for name, next_id in tables:
                cur.execute(f"TRUNCATE TABLE `{name}`")
                if next_id:
                    cur.execute(f"ALTER TABLE `{name}` AUTO_INCREMENT = {int(next_id)}")
        finally:
            cur.execute("SET SESSION foreign_key_checks = 1")


def analyze() -> None:
    from django.db import connection

    with connection.cursor() as cur:
        if is_mariadb():
            cur.execute("ANALYZE TABLE fanout_itemclaim, fanout_batchrun")
            cur.fetchall()
            return
        cur.execute("ANALYZE fanout_itemclaim")
        cur.execute("ANALYZE fanout_batchrun")


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/PID/stat from field 3 on (the command name may hold spaces); [] if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used."""
    f = _stat_fields(pid)
    return (int(f[11]) + int(f[12])) / CLK_TCK if f else 0.0


def thread_cpu(tid: int) -> float:
    """CPU seconds of one thread: /proc/TID/stat would give its whole process's."""
    f = _stat_fields(f"{tid}/task/{tid}")
    return (int(f[11]) + int(f[12])) / CLK_TCK if f else 0.0


def our_backends() -> dict[int, float]:
    """CPU seconds of each PostgreSQL backend connected to the bench database (by its process
    title, "postgres: ... USER DBNAME HOST(PORT) STATE"): other users' databases left out.
    On MariaDB, of each connection thread on the bench database."""
    if is_mariadb():
        return {tid: thread_cpu(tid) for tid in mariadb_threads()}
    name = f" {db_settings()['NAME']} "
    found: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "postgres":
                continue
            if name not in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                continue
        except (OSError, UnicodeDecodeError):
            continue
        cpu = process_cpu(int(entry.name))
        if cpu:
            found[int(entry.name)] = cpu
    return found


def mariadb_threads() -> list[int]:
    """Linux thread ids of the MariaDB connections on the bench database (MariaDB runs one
    thread per connection and shows its id in PROCESSLIST.TID). Asked on a connection of no
    database, so that it does not count itself."""
    conn = mysql_connect()
    try:
        cur = conn.cursor()
        cur.execute(
            "SELECT tid FROM information_schema.processlist WHERE db = %s AND tid IS NOT NULL",
            (db_settings()["NAME"],),
        )
        return [int(row[0]) for row in cur.fetchall()]
    finally:
        conn.close()


def mariadb_all_threads() -> dict[int, float]:
    """CPU seconds of every thread of this host's MariaDB server: a connection thread is
    reused after its connection closes, so a thread first seen mid-run counts from here."""
    found: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() not in ("mariadbd", "mysqld"):
                continue
            tasks = list((entry / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            found[int(task.name)] = thread_cpu(int(task.name))
    return found


def machine_busy() -> float:
    """CPU seconds the whole machine spent busy (not idle, not waiting on I/O)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / CLK_TCK


class Usage:
    """Where the CPU went while ``n`` items ran: in the given processes (the workers, or this
    one), in the PostgreSQL backends of the bench database, and machine-wide (other users'
    load included). Backends come and go with drain jobs: the known ones are read every 0.1 s
    (each one's last figure counts), and new ones looked for every 0.5 s.

    On MariaDB the backends are connection threads, which outlive their connections and may
    serve another database next: a thread is read only while it serves the bench database,
    from its figure when the measurement started."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.started = time.monotonic()
        self.cpu = sum(process_cpu(pid) for pid in pids)
        self.busy = machine_busy()
        self.mariadb = is_mariadb()
        if self.mariadb:
            self.base = mariadb_all_threads()
            self.seen = our_backends()
        else:
            self.base = our_backends()
            self.seen = dict(self.base)
        self.live = set(self.seen)
        self.done = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        ticks = 0
        while not self.done.wait(0.1):
            ticks += 1
            if ticks % 5 == 0:
                self._look()
                continue
            for pid in list(self.live):
                cpu = thread_cpu(pid) if self.mariadb else process_cpu(pid)
                if cpu:  # 0 once it has exited: keep its last figure
                    self.seen[pid] = max(cpu, self.seen[pid])

    def _look(self) -> None:
        try:
            found = our_backends()
        except db_errors():  # MariaDB went away: the measurement's own queries will say so
            return
        if self.mariadb:
            for tid, cpu in found.items():
                self.seen[tid] = max(cpu, self.seen.get(tid, 0.0))
            self.live = set(found)
        else:
            self.seen.update(found)
            self.live = set(self.seen)

    def stop(self) -> None:
        self.done.set()
        self.watcher.join()

    def per_item(self, n: int, postgres: float | None = None) -> dict[str, float]:
        """Per item of ``n``; ``postgres``: the server's CPU seconds, when known exactly."""
        self.stop()  # once more is harmless
        self._look()
        wall = time.monotonic() - self.started
        ours = sum(process_cpu(pid) for pid in self.pids) - self.cpu
        pg = sum(cpu - self.base.get(pid, 0.0) for pid, cpu in self.seen.items())
        if postgres is not None:
            pg = postgres
        wall = max(wall, 1e-9)
        return {
            "cpu_ms_per_item": ours * 1000 / n,
            server_cpu_field(): pg * 1000 / n,
            "our_cores": (ours + pg) / wall,
            "busy_cores": (machine_busy() - self.busy) / wall,
        }


def code_digest() -> str:
    """A digest of fanout's source and migrations: the code under test may change during a run."""
    import hashlib

    digest = hashlib.sha1()
    for path in sorted((ROOT / "fanout").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


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
            if is_mariadb():
                # What decides a commit's cost: the redo log's flush, the binary log's sync.
                cur.execute(
                    "SELECT VERSION(), @@innodb_flush_log_at_trx_commit, @@sync_binlog, "
                    "@@log_bin, @@innodb_buffer_pool_size"
                )
                row = cur.fetchone()
                keys = ("flush_log_at_trx_commit", "sync_binlog", "log_bin", "buffer_pool_size")
                info["mariadb"] = row[0]
                info.update({f"mariadb_{k}": v for k, v in zip(keys, row[1:], strict=True)})
            else:
                cur.execute("SHOW server_version")
                info["postgresql"] = cur.fetchone()[0]
                for setting in ("synchronous_commit", "shared_buffers", "fsync"):
                    cur.execute(f"SHOW {setting}")
                    info[f"pg_{setting}"] = cur.fetchone()[0]
        info["redis"] = redis_conn().info("server").get("redis_version")
        import django
        import rq

        info["django"] = django.get_version()
        if is_mariadb():
            import MySQLdb

            info["mysqlclient"] = ".".join(str(x) for x in MySQLdb.version_info[:3])
        else:
            import psycopg

            info["psycopg"] = psycopg.__version__
        info["rq"] = rq.__version__
    except Exception as exc:  # informational only
        info["error"] = str(exc)
    return info


# ------------------------------------------------------------------------ runs through fanout


def db_time() -> datetime:
    """The database server's time: fanout writes runs' started_at and finished_at by it."""
    from fanout.clock import db_now

    return db_now()


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
            from fanout.actions import cancel_run

            cancel_run(run, "benchmark timed out")
            raise RuntimeError(f"run {run_id} did not finish within {timeout:.0f} s")
        time.sleep(0.01)


def one_run(
    name: str,
    n: int,
    executor: str,
    workers: int | None,
    pool: Workers | None,
    fresh: bool = True,
) -> dict[str, Any]:
    """Start a run of ``n`` items and wait for its join; return timings from start to join.

    ``workers`` is the inline executor's threads; through RQ it is None, so the run gets the
    library's default number of drain jobs, each running FANOUT_WORKER_THREADS items at once.
    ``fresh`` empties fanout's tables first; the consecutive runs keep the rows before them.
    """
    from fanout.definition import get_definition

    definition = get_definition(name)
    if fresh:
        reset_tables()
    if pool is not None:
        pool.wait_idle()
    usage = Usage(pool.pids() if pool is not None else [os.getpid()])
    try:
        t0 = db_time()
        run = definition.start(
            {"n": n}, run_key(name), executor=executor, workers=workers, wait=executor == "inline"
        )
        if executor == "rq":
            run = wait_run(run.pk, timeout=120 + n / 100, workers=pool)
    finally:
        usage.stop()
    cpu = usage.per_item(n)
    ok = run.status == "succeeded" and run.join_result == n and run.join_runs == 1
    if not ok:
        raise RuntimeError(
            f"{name} via {executor}: run {run.pk} ended {run.status}, join_result "
            f"{run.join_result!r} (want {n}), join_runs {run.join_runs}: {run.error[:500]}"
        )
    elapsed = (run.finished_at - t0).total_seconds()
    return {
        "run_id": run.pk,
        "seconds": elapsed,
        "items_per_s": n / elapsed,
        "materialize_s": (run.started_at - t0).total_seconds(),
        "drain_and_join_s": (run.finished_at - run.started_at).total_seconds(),
        **cpu,
    }


def handler_spans(run_id: int) -> list[tuple[float, float]]:
    """[(start, end)] of every handler of a run whose handler returns its own start and end."""
    from fanout.models import ItemClaim

    rows = ItemClaim.objects.filter(run_id=run_id).values_list("result", flat=True)
    return [(r[0], r[1]) for r in rows]


def run_entry(
    name: str, n: int, executor: str, workers: int, samples: list[dict[str, Any]]
) -> dict[str, Any]:
    from fanout.definition import get_definition

    definition = get_definition(name)
    return {
        "definition": name,
        "items": n,
        "executor": executor,
        "workers": workers,
        "batch_size": definition.batch_size,
        "max_parallel": definition.max_parallel,
        "items_per_s": stats([s["items_per_s"] for s in samples]),
        "seconds": stats([s["seconds"] for s in samples]),
        "materialize_s": stats([s["materialize_s"] for s in samples]),
        "drain_and_join_s": stats([s["drain_and_join_s"] for s in samples]),
        **{k: stats([s[k] for s in samples]) for k in cpu_fields()},
    }


def warm_up(pool: Workers) -> None:
    """One small untimed run, so that the first timed one does not pay the workers' start."""
    retry_db("warm-up", lambda: one_run("bench.noop_each", 50, "rq", None, pool))


def logged(key: str, n: int, res: dict[str, Any], r: int) -> None:
    log(
        f"  {key} #{r + 1}: {n} items in {res['seconds']:.2f} s = "
        f"{res['items_per_s']:,.0f}/s (materialize {res['materialize_s']:.2f} s; CPU per item: "
        f"{res['cpu_ms_per_item']:.2f} ms client, {res[server_cpu_field()]:.2f} ms "
        f"{server_name()}; cores: {res['our_cores']:.2f} ours, {res['busy_cores']:.2f} busy)"
    )


# --------------------------------------------------------------------- 1. per-item commit


def per_item_repeat(cfg: argparse.Namespace, logdir: Path, r: int) -> dict[str, dict[str, Any]]:
    """One repeat: RQ 1 worker, the bare 2-transaction loop, RQ 2 workers, 20 ms items."""
    n, n_slow = cfg.each_items, cfg.slow_items
    found: dict[str, dict[str, Any]] = {}
    with Workers(1, logdir) as pool:
        warm_up(pool)
        found["rq1"] = retry_db(
            "per_item/rq1", lambda: one_run("bench.noop_each", n, "rq", None, pool)
        )
    logged("per_item_commit/rq1", n, found["rq1"], r)
    found["bare"] = retry_db("bare_2tx_2conn", partial(bare_once, n, 1, 2, two_tx=True))
    log(
        f"  bare_2tx_2conn #{r + 1}: {n} rows in {found['bare']['seconds']:.2f} s = "
        f"{found['bare']['items_per_s']:,.0f}/s"
    )
    with Workers(2, logdir) as pool:
        warm_up(pool)
        found["rq2"] = retry_db(
            "per_item/rq2", lambda: one_run("bench.noop_each", n, "rq", None, pool)
        )
        logged("per_item_commit/rq2", n, found["rq2"], r)
        found["slow"] = retry_db(
            "sleep20ms/rq2", lambda: one_run("bench.sleep20ms", n_slow, "rq", None, pool)
        )
    found["slow"]["max_in_flight"] = max_overlap(handler_spans(found["slow"]["run_id"]))
    logged("sleep20ms/rq2", n_slow, found["slow"], r)
    return found


def phase_per_item(cfg: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """Issue 10's per-item targets, with the library's defaults (batch_size 1, default threads).

    Each ratio is taken within its repeat, whose figures are seconds apart: on a shared
    machine, figures measured minutes apart would mostly measure the load's drift.
    """
    from bench.fanouts import SLOW_MAX_PARALLEL, SLOW_SLEEP

    limit = SLOW_MAX_PARALLEL / SLOW_SLEEP
    repeats = []
    for r in range(cfg.repeats):
        found = per_item_repeat(cfg, logdir, r)
        found["ratios"] = {
            "to_bare": found["rq2"]["items_per_s"] / found["bare"]["items_per_s"],
            "scaling": found["rq2"]["items_per_s"] / found["rq1"]["items_per_s"],
        }
        repeats.append(found)
        log(
            f"    20 ms: {found['slow']['items_per_s'] / limit:.1%} of {limit:.0f}/s, at most "
            f"{found['slow']['max_in_flight']} at once; RQ 2 workers / bare 2-tx loop "
            f"{found['ratios']['to_bare']:.2f}, / RQ 1 worker {found['ratios']['scaling']:.2f}"
        )
    reset_tables()
    peak = max(f["slow"]["max_in_flight"] for f in repeats)
    slow = run_entry("bench.sleep20ms", cfg.slow_items, "rq", 2, [f["slow"] for f in repeats])
    slow.update(
        limit=f"{SLOW_MAX_PARALLEL} at once x {SLOW_SLEEP * 1000:.0f} ms = {limit:.0f} items/s",
        limit_items_per_s=limit,
        fraction_of_limit=stats([f["slow"]["items_per_s"] / limit for f in repeats]),
        max_in_flight=peak,
        exceeded=peak > SLOW_MAX_PARALLEL,
    )
    bare = [f["bare"] for f in repeats]
    return {
        "bare_2tx_2conn": {
            "items": cfg.each_items,
            "batch": 1,
            "connections": 2,
            "transactions_per_item": 2,
            **{k: stats([s[k] for s in bare]) for k in ("items_per_s", "seconds", *cpu_fields())},
        },
        "per_item_commit/rq1": run_entry(
            "bench.noop_each", cfg.each_items, "rq", 1, [f["rq1"] for f in repeats]
        ),
        "per_item_commit/rq2": run_entry(
            "bench.noop_each", cfg.each_items, "rq", 2, [f["rq2"] for f in repeats]
        ),
        "sleep20ms/rq2": slow,
        "ratio_rq2_to_bare_2tx_2conn": stats([f["ratios"]["to_bare"] for f in repeats]),
        "ratio_rq2_to_rq1": stats([f["ratios"]["scaling"] for f in repeats]),
        "worker_threads": worker_threads(),
    }


def worker_threads() -> int:
    from fanout.conf import conf

    return int(conf.WORKER_THREADS)


def library_defaults() -> dict[str, Any]:
    """What the per-item runs inherit: they set neither batch_size nor the threads."""
    from django.conf import settings

    from fanout.conf import conf

    return {
        "fanout_batch_size": conf.BATCH_SIZE,
        "fanout_worker_threads": conf.WORKER_THREADS,
        "fanout_drain_seconds": conf.DRAIN_SECONDS,
        "rq_worker_class": getattr(settings, "RQ", {}).get("WORKER_CLASS", "rq.Worker"),
    }


# ------------------------------------------------------------------------ spend accounting


def phase_spend(cfg: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """What counting cost adds per item: the per-item run, then the same with an estimate per
    item, then with a run budget too, back to back on the same two RQ workers in each repeat;
    each ratio is taken within its repeat."""
    n = cfg.each_items
    names = {
        "plain": "bench.noop_each",
        "cost": "bench.noop_each_cost",
        "budget": "bench.noop_each_budget",
    }
    repeats = []
    for r in range(cfg.repeats):
        found: dict[str, dict[str, Any]] = {}
        with Workers(2, logdir) as pool:
            warm_up(pool)
            for label, name in names.items():
                found[label] = retry_db(
                    f"spend/{label}", lambda name=name: one_run(name, n, "rq", None, pool)
                )
                logged(f"spend/{label}", n, found[label], r)
        found["ratios"] = {
            label: found[label]["items_per_s"] / found["plain"]["items_per_s"]
            for label in ("cost", "budget")
        }
        log(
            f"    items/s with cost / without {found['ratios']['cost']:.3f}, "
            f"with a budget / without {found['ratios']['budget']:.3f}"
        )
        repeats.append(found)
    reset_tables()
    out: dict[str, Any] = {
        f"per_item_commit/{label}": run_entry(name, n, "rq", 2, [f[label] for f in repeats])
        for label, name in names.items()
    }
    for label in ("cost", "budget"):
        ratios = [f["ratios"][label] for f in repeats]
        out[f"ratio_{label}_to_plain"] = stats(ratios)
        out[f"overhead_{label}"] = stats([1 / x - 1 for x in ratios])
    return out


# ------------------------------------------------------------------ 2. batched throughput


def phase_throughput(cfg: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """No-op and 1 ms definitions in batches through RQ (1 and 2 workers) and inline (1 and 2
    threads)."""
    cases = [
        ("noop", "bench.noop", cfg.items),
        ("sleep1ms", "bench.sleep1ms", cfg.sleep_items),
    ]
    out: dict[str, Any] = {}

    def measure(label: str, name: str, n: int, executor: str, workers: int, pool: Any) -> None:
        key = f"{label}/{executor}{workers}"
        threads = workers if executor == "inline" else None
        samples = []
        for r in range(cfg.repeats):
            res = retry_db(key, lambda: one_run(name, n, executor, threads, pool))
            samples.append(res)
            logged(key, n, res, r)
        out[key] = run_entry(name, n, executor, workers, samples)

    for count in (1, 2):
        log(f"throughput: RQ with {count} rqworker process(es)")
        with Workers(count, logdir) as pool:
            warm_up(pool)
            for label, name, n in cases:
                measure(label, name, n, "rq", count, pool)
    # Inline, half the no-op items: these runs are no target, and the full run must stay short.
    inline_cases = [("noop", "bench.noop", max(100, cfg.items // 2)), cases[1]]
    for threads in cfg.inline_workers:
        log(f"throughput: inline executor, {threads} thread(s)")
        for label, name, n in inline_cases:
            measure(label, name, n, "inline", threads, None)
    reset_tables()
    return out


# ------------------------------------------------- 2. bare claim loops (printed with the above)

BARE_DDL = """
DROP TABLE IF EXISTS bench_bare;
CREATE TABLE bench_bare (
    id bigserial PRIMARY KEY,
    run_id integer NOT NULL,
    key varchar(255) NOT NULL,
    index integer NOT NULL,
    payload jsonb,
    status varchar(16) NOT NULL DEFAULT 'pending',
    owner varchar(255) NOT NULL DEFAULT '',
    claimed_at timestamptz,
    lease_expires_at timestamptz,
    finished_at timestamptz,
    UNIQUE (run_id, key)
);
CREATE INDEX bench_bare_pending ON bench_bare (run_id, index) WHERE status = 'pending';
"""


def bare_fill(n: int) -> None:
    if is_mariadb():
        bare_fill_mariadb(n)
        return
    import psycopg

    with psycopg.connect(conninfo(), autocommit=True) as conn:
        conn.execute(BARE_DDL)
        conn.execute(
            "INSERT INTO bench_bare (run_id, key, index, payload) "
            "SELECT 1, g::text, g, jsonb_build_object('n', g) FROM generate_series(0, %s) g",
            (n - 1,),
        )
        conn.execute("VACUUM ANALYZE bench_bare")


CLAIM_SQL = (
    "SELECT id, payload FROM bench_bare WHERE run_id = 1 AND status = 'pending' "
    "ORDER BY index LIMIT %s FOR UPDATE SKIP LOCKED"
)


def bare_loop(batch: int, two_tx: bool = False, backend_cpu: list[float] | None = None) -> int:
    """Claim ``batch`` pending rows with SKIP LOCKED and mark them done, one transaction each;
    with ``two_tx``, mark them running (owner, lease) in the claim's transaction and done in a
    second one, as claim durably, run, record needs. The connection's backend adds the CPU
    it used to ``backend_cpu`` before it closes."""
    if is_mariadb():
        return bare_loop_mariadb(batch, two_tx, backend_cpu)
    import psycopg

    owner = f"bare-{threading.get_ident()}"
    done = 0
    with psycopg.connect(conninfo(), autocommit=True) as conn:
        while True:
            with conn.transaction():
                rows = conn.execute(CLAIM_SQL, (batch,)).fetchall()
                if not rows:
                    if backend_cpu is not None:
                        backend_cpu.append(process_cpu(conn.info.backend_pid))
                    return done
                ids = [r[0] for r in rows]
                if two_tx:
                    conn.execute(
                        "UPDATE bench_bare SET status = 'running', owner = %s, claimed_at = now(), "
                        "lease_expires_at = now() + interval '30 seconds' WHERE id = ANY(%s)",
                        (owner, ids),
                    )
                else:
                    conn.execute(
                        "UPDATE bench_bare SET status = 'succeeded', finished_at = now() "
                        "WHERE id = ANY(%s)",
                        (ids,),
                    )
            if two_tx:
                with conn.transaction():
                    conn.execute(
                        "UPDATE bench_bare SET status = 'succeeded', finished_at = now() "
                        "WHERE id = ANY(%s) AND owner = %s",
                        (ids, owner),
                    )
            done += len(rows)


# The same table on MariaDB. No partial index there: the composite one that fanout's own claim
# uses on MariaDB (run, status, index).
BARE_DDL_MARIADB = (
    "DROP TABLE IF EXISTS bench_bare",
    """CREATE TABLE bench_bare (
    id bigint AUTO_INCREMENT PRIMARY KEY,
    run_id integer NOT NULL,
    `key` varchar(255) NOT NULL,
    `index` integer NOT NULL,
    payload json,
    status varchar(16) NOT NULL DEFAULT 'pending',
    owner varchar(255) NOT NULL DEFAULT '',
    claimed_at datetime(6),
    lease_expires_at datetime(6),
    finished_at datetime(6),
    UNIQUE (run_id, `key`),
    KEY bench_bare_pending (run_id, status, `index`)
) ENGINE=InnoDB""",
)

CLAIM_SQL_MARIADB = (
    "SELECT id, payload FROM bench_bare WHERE run_id = 1 AND status = 'pending' "
    "ORDER BY `index` LIMIT %s FOR UPDATE SKIP LOCKED"
)


def bare_fill_mariadb(n: int) -> None:
    conn = mysql_connect(dbname=db_settings()["NAME"])
    try:
        cur = conn.cursor()
        for statement in BARE_DDL_MARIADB:
            cur.execute(statement)
        sql = "INSERT INTO bench_bare (run_id, `key`, `index`, payload) VALUES (1, %s, %s, %s)"
        for start in range(0, n, 1000):  # MySQLdb sends each chunk as one multi-row INSERT
            rows = [(str(g), g, json.dumps({"n": g})) for g in range(start, min(n, start + 1000))]
            cur.executemany(sql, rows)
        conn.commit()
        cur.execute("ANALYZE TABLE bench_bare")
        cur.fetchall()
    finally:
        conn.close()


def bare_loop_mariadb(batch: int, two_tx: bool, backend_cpu: list[float] | None) -> int:
    """bare_loop with MySQLdb: the same statements, at READ COMMITTED as Django runs fanout on
    MariaDB. The connection's thread outlives it (MariaDB caches threads), so its CPU is read
    at the start and at the end."""
    owner = f"bare-{threading.get_ident()}"
    done = 0
    conn = mysql_connect(dbname=db_settings()["NAME"])
    try:
        cur = conn.cursor()
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        cur.execute("SELECT tid FROM information_schema.processlist WHERE id = CONNECTION_ID()")
        tid = int(cur.fetchone()[0])
        conn.commit()
        cpu_before = thread_cpu(tid)
        while True:
            cur.execute(CLAIM_SQL_MARIADB, (batch,))
            rows = cur.fetchall()
            if not rows:
                conn.commit()
                if backend_cpu is not None:
                    backend_cpu.append(thread_cpu(tid) - cpu_before)
                return done
            ids = [r[0] for r in rows]
            marks = ", ".join(["%s"] * len(ids))
            if two_tx:
                cur.execute(
                    "UPDATE bench_bare SET status = 'running', owner = %s, claimed_at = NOW(6), "
                    f"lease_expires_at = NOW(6) + INTERVAL 30 SECOND WHERE id IN ({marks})",
                    (owner, *ids),
                )
            else:
                cur.execute(
                    "UPDATE bench_bare SET status = 'succeeded', finished_at = NOW(6) "
                    f"WHERE id IN ({marks})",
                    ids,
                )
            conn.commit()
            if two_tx:
                cur.execute(
                    "UPDATE bench_bare SET status = 'succeeded', finished_at = NOW(6) "
                    f"WHERE id IN ({marks}) AND owner = %s",
                    (*ids, owner),
                )
                conn.commit()
            done += len(rows)
    finally:
        conn.close()


def bare_once(n: int, batch: int, conns: int, two_tx: bool = False) -> dict[str, float]:
    """Fill the bare table with ``n`` rows, drain it with ``conns`` loops; return the seconds
    and where the CPU went."""
    bare_fill(n)
    counts: list[int] = []
    errors: list[BaseException] = []
    backend_cpu: list[float] = []

    def loop() -> None:
        try:
            counts.append(bare_loop(batch, two_tx, backend_cpu))
        except BaseException as exc:  # re-raised in the caller, where retry_db sees it
            errors.append(exc)

    threads = [threading.Thread(target=loop) for _ in range(conns)]
    usage = Usage([os.getpid()])
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    # Exact: each loop read its backend's CPU before closing (a backend lives for one loop).
    cpu = usage.per_item(n, postgres=sum(backend_cpu))
    if errors:
        raise errors[0]
    if sum(counts) != n:
        raise RuntimeError(f"bare loop: {sum(counts)} rows done, want {n}")
    return {"seconds": elapsed, "items_per_s": n / elapsed, **cpu}


def drop_bare() -> None:
    if is_mariadb():
        conn = mysql_connect(dbname=db_settings()["NAME"])
        try:
            conn.cursor().execute("DROP TABLE IF EXISTS bench_bare")
        finally:
            conn.close()
        return
    import psycopg

    with psycopg.connect(conninfo(), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_bare")


def phase_baseline(cfg: argparse.Namespace) -> dict[str, Any]:
    """The one-transaction bare loops (the 2-transaction loop is measured beside the per-item
    runs it is compared with)."""
    out: dict[str, Any] = {}
    cases = [
        ("bare_1_per_tx", 1, 1, cfg.bare_items),
        ("bare_1_per_tx_2conn", 1, 2, cfg.bare_items),
        ("bare_100_per_tx", 100, 1, cfg.items),
    ]
    for label, batch, conns, n in cases:
        samples = []
        for r in range(cfg.repeats):
            samples.append(retry_db(label, partial(bare_once, n, batch, conns)))
            log(
                f"  {label} #{r + 1}: {n} rows in {samples[-1]['seconds']:.2f} s = "
                f"{samples[-1]['items_per_s']:,.0f}/s"
            )
        out[label] = {
            "items": n,
            "batch": batch,
            "connections": conns,
            "transactions_per_item": 1 / batch,
            **{
                k: stats([s[k] for s in samples]) for k in ("items_per_s", "seconds", *cpu_fields())
            },
        }
    drop_bare()
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
    sql, constants = filler_insert()
    with connection.cursor() as cur:
        for i in range(0, len(runs), 10):
            ids = [run.pk for run in runs[i : i + 10]]
            if is_mariadb():
                cur.execute(sql.format(ids=", ".join(["%s"] * len(ids))), [*constants, *ids])
            else:
                cur.execute(sql, [*constants, ids, FILLER_PER_RUN - 1])
    analyze()


def filler_insert() -> tuple[str, list[Any]]:
    """``INSERT … SELECT`` of succeeded items, 10,000 per run of ``unnest(%s)``: every column of
    the model, so that a column fanout adds gets its default (as ``save()`` would give it).
    On MariaDB the SEQUENCE engine's ``seq_0_to_N`` stands in for ``generate_series``, and the
    runs are ``{ids}``, to be formatted with as many placeholders as runs."""
    from django.db import connection
    from django.db.models.expressions import DatabaseDefault
    from django.utils import timezone

    from fanout.models import ItemClaim

    now = timezone.now()
    template = ItemClaim(
        run_id=0,
        pool="",
        status="succeeded",
        owner="bench",
        claimed_at=now,
        attempt=1,
        crashes=0,
        next_attempt_at=now,
        error="",
        error_class="",
        started_at=now,
        finished_at=now,
    )
    varying = {
        "run": "r",
        "key": "g::text",
        "index": "g",
        "payload": "jsonb_build_object('n', g)",
        "result": "'null'::jsonb",
    }
    if is_mariadb():
        varying = {
            "run": "r.id",
            "key": "CAST(g.seq AS CHAR)",
            "index": "g.seq",
            "payload": "JSON_OBJECT('n', g.seq)",
            "result": "'null'",
        }
    columns, values, constants = [], [], []
    for field in ItemClaim._meta.concrete_fields:
        value = getattr(template, field.attname)
        if field.primary_key or isinstance(value, DatabaseDefault):
            continue
        columns.append(connection.ops.quote_name(field.column))
        if field.name in varying:
            values.append(varying[field.name])
        else:
            values.append("%s")
            constants.append(field.get_db_prep_save(value, connection))
    sql = (
        f"INSERT INTO {ItemClaim._meta.db_table} ({', '.join(columns)}) "
        f"SELECT {', '.join(values)} FROM unnest(%s::bigint[]) r, generate_series(0, %s) g"
    )
    if is_mariadb():
        sql = (
            f"INSERT INTO {ItemClaim._meta.db_table} ({', '.join(columns)}) "
            f"SELECT {', '.join(values)} FROM fanout_batchrun r "
            f"JOIN seq_0_to_{FILLER_PER_RUN - 1} g WHERE r.id IN ({{ids}})"
        )
    return sql, constants


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


def pool_run(
    name: str, n: int, executor: str, threads: int | None, pool: Workers | None
) -> tuple[Any, float]:
    """Run ``n`` items of a pool-limited definition; return the run and start → join seconds."""
    from fanout.definition import get_definition

    reset_tables()  # also the pools: every repeat starts with a fresh pool row and full bucket
    if pool is not None:
        pool.wait_idle()
    t0 = db_time()
    run = get_definition(name).start(
        {"n": n}, run_key(name), executor=executor, workers=threads, wait=executor == "inline"
    )
    if executor == "rq":
        run = wait_run(run.pk, timeout=120 + n, workers=pool)
    if run.status != "succeeded" or run.join_result != n:
        raise RuntimeError(f"{name} via {executor} ended {run.status}: {run.error[:300]}")
    return run, (run.finished_at - t0).total_seconds()


def pool_concurrency(
    cfg: argparse.Namespace, executor: str, threads: int | None, pool: Workers | None
) -> dict[str, Any]:
    """Concurrency 4, 50 ms handler: the limit is 4 / 0.05 = 80 items/s, and never above 4."""
    from django.conf import settings

    from bench.fanouts import POOL_SLEEP
    from fanout.models import ItemClaim

    conc = settings.FANOUT_POOLS["bench-conc4"]["max_concurrency"]
    limit = conc / POOL_SLEEP
    n = cfg.pool_conc_items
    fractions, speeds, peaks, steady = [], [], [], []
    for r in range(cfg.repeats):
        run, elapsed = retry_db(
            "pool concurrency",
            partial(pool_run, "bench.pool_conc4", n, executor, threads, pool),
        )
        rows = list(
            ItemClaim.objects.filter(run=run).values_list("claimed_at", "finished_at", "result")
        )
        lease_side = max_overlap([(c.timestamp(), f.timestamp()) for c, f, _ in rows])
        spans = [(res[0], res[1]) for _, _, res in rows]
        handlers = max_overlap(spans)
        # Items/s from the first handler's start to the last one's end: start-up and join left out.
        span = max(e for _, e in spans) - min(s for s, _ in spans)
        speeds.append(n / elapsed)
        fractions.append(n / elapsed / limit)
        steady.append(n / span / limit)
        peaks.append(max(lease_side, handlers))
        log(
            f"  pool concurrency {conc}, {executor} #{r + 1}: {n / elapsed:.1f} items/s = "
            f"{n / elapsed / limit:.1%} of {limit:.0f}/s ({n / span / limit:.1%} from the first "
            f"handler to the last); at most {handlers} handlers and {lease_side} claims at once"
        )
    return {
        "items": n,
        "executor": executor,
        "workers": threads if executor == "inline" else 2,
        "limit": f"{conc} at once x {POOL_SLEEP * 1000:.0f} ms = {limit:.0f} items/s",
        "limit_items_per_s": limit,
        "max_concurrency": conc,
        "items_per_s": stats(speeds),
        "fraction_of_limit": stats(fractions),
        "fraction_of_limit_handlers_span": stats(steady),
        "max_in_flight": max(peaks),
        "exceeded": max(peaks) > conc,
    }


def pool_rate(cfg: argparse.Namespace) -> dict[str, Any]:
    """Rate 50/s, burst 5, no-op handler, inline: never more than the token bucket allows."""
    from django.conf import settings

    from fanout.models import ItemClaim
    from fanout.pools import parse_rate

    rate_cfg = settings.FANOUT_POOLS["bench-rate50"]
    rate_count, rate_period = parse_rate(rate_cfg["rate"])
    rate = rate_count / rate_period
    burst = rate_cfg.get("burst") or rate_count
    n = cfg.pool_rate_items
    fractions, speeds, windows, excesses = [], [], [], []
    for r in range(cfg.repeats):
        run, elapsed = retry_db(
            "pool rate",
            partial(pool_run, "bench.pool_rate50", n, "inline", cfg.pool_threads, None),
        )
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
    return {
        "items": n,
        "executor": "inline",
        "workers": cfg.pool_threads,
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


def phase_pools(cfg: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """The concurrency pool through RQ (2 workers, default threads) and inline (8 threads);
    the rate pool inline."""
    out: dict[str, Any] = {}
    with Workers(2, logdir) as pool:
        warm_up(pool)
        out["concurrency4_50ms/rq2"] = pool_concurrency(cfg, "rq", None, pool)
    out[f"concurrency4_50ms/inline{cfg.pool_threads}"] = pool_concurrency(
        cfg, "inline", cfg.pool_threads, None
    )
    out["rate50/inline"] = pool_rate(cfg)
    reset_tables()
    return out


# -------------------------------------------------------------------------- 6. scheduling


def concurrency(spans: list[tuple[float, float]]) -> tuple[float, int]:
    """Handlers' effective concurrency (their seconds over the wall span from the first start
    to the last end) and the most that ran at any instant, from their own start/end times."""
    if not spans:
        return 0.0, 0
    busy = sum(end - start for start, end in spans)
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return busy / wall if wall > 0 else 0.0, peak


def start_runs(
    name: str, params: dict[str, Any], count: int, pool: Workers | None = None
) -> list[int]:
    """Start ``count`` runs; with ``pool``, while its workers are paused, so that the runs
    reach them together (what is measured is how workers share runs, not how fast this loop
    writes them)."""
    from fanout.definition import get_definition

    definition = get_definition(name)
    if pool is not None:
        pool.pause()
    try:
        return [
            definition.start(params, run_key(name), executor="rq", wait=False).pk
            for _ in range(count)
        ]
    finally:
        if pool is not None:
            pool.resume()


def sched_many_runs(pool: Workers) -> dict[str, Any]:
    """24 runs with max_parallel=2, 10 items of 100 ms each, started together."""
    reset_tables()
    pool.wait_idle()
    began = time.monotonic()
    ids = start_runs("bench.small_runs", {"n": 10}, 24, pool)
    started = time.monotonic() - began
    for run_id in ids:
        wait_run(run_id, timeout=300, workers=pool)
    spans = [s for run_id in ids for s in handler_spans(run_id)]
    effective, peak = concurrency(spans)
    gaps = thread_gaps(ids)
    return {
        "runs": len(ids),
        "items": len(spans),
        "threads": 2 * worker_threads(),
        "seconds": time.monotonic() - began,
        "start_seconds": started,
        "first_start_to_last_end": max(e for _, e in spans) - min(s for s, _ in spans),
        "effective_concurrency": effective,
        "peak_concurrency": peak,
        "gap_between_items_ms": stats([g * 1000 for g in gaps]),
        "running_every_100ms": timeline(spans, 0.1),
    }


def timeline(spans: list[tuple[float, float]], step: float) -> list[int]:
    """Handlers running at each ``step`` from the first start: where the threads idled."""
    first = min(start for start, _ in spans)
    last = max(end for _, end in spans)
    ticks = [first + step * i for i in range(int((last - first) / step) + 1)]
    return [sum(1 for start, end in spans if start <= t < end) for t in ticks]


def thread_gaps(run_ids: list[int]) -> list[float]:
    """Seconds each worker thread spent between one handler's end and its next one's start."""
    from collections import defaultdict

    from fanout.models import ItemClaim

    by_thread: dict[str, list[tuple[float, float]]] = defaultdict(list)
    rows = ItemClaim.objects.filter(run_id__in=run_ids).values_list("owner", "result")
    for owner, result in rows:
        by_thread[owner].append((result[0], result[1]))
    gaps = []
    for spans in by_thread.values():
        spans.sort()
        gaps += [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
    return gaps


def sched_tree(pool: Workers) -> dict[str, Any]:
    """A parent with max_parallel=4 over 8 child runs (10 items of 100 ms, max_parallel=2)."""
    from fanout.models import BatchRun

    reset_tables()
    pool.wait_idle()
    [parent] = start_runs("bench.tree_parent", {"n": 8, "child_items": 10}, 1)
    run = wait_run(parent, timeout=300, workers=pool)
    children = BatchRun.objects.filter(parent_item__run_id=parent).values_list("pk", flat=True)
    # A child run is alive from its first handler's start to its last handler's end.
    alive = []
    for child in children:
        spans = handler_spans(child)
        if spans:
            alive.append((min(s for s, _ in spans), max(e for _, e in spans)))
    return {
        "parent_status": run.status,
        "children": len(children),
        "max_children_alive": concurrency(alive)[1],
    }


def sched_hosts(logdir: Path) -> dict[str, Any]:
    """host_max_parallel=2 on two hosts (FANOUT_HOST_NAME) of 2 workers each: 240 x 50 ms."""
    from fanout.models import ItemClaim

    reset_tables()
    hosts = ("bench-host-a", "bench-host-b")
    pools = [Workers(2, logdir, env={"FANOUT_HOST_NAME": host}) for host in hosts]
    with pools[0], pools[1]:
        [run_id] = start_runs("bench.host_limit", {"n": 240}, 1)
        run = wait_run(run_id, timeout=300, workers=pools[0])
    rows = ItemClaim.objects.filter(run_id=run_id).values_list("result", flat=True)
    per_host = {h: concurrency([(r[0], r[1]) for r in rows if r[2] == h])[1] for h in hosts}
    return {
        "status": run.status,
        "items": len(rows),
        "peak_concurrency": concurrency([(r[0], r[1]) for r in rows])[1],
        "peak_per_host": per_host,
    }


def phase_scheduling(cfg: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """Issue 21: many small runs and a tree share the workers' threads; a per-host limit holds
    on two hosts and uses both."""
    out: dict[str, Any] = {}
    with Workers(2, logdir) as pool:
        warm_up(pool)
        out["many_runs"] = retry_db("scheduling/many_runs", lambda: sched_many_runs(pool))
        out["tree"] = retry_db("scheduling/tree", lambda: sched_tree(pool))
    out["hosts"] = retry_db("scheduling/hosts", lambda: sched_hosts(logdir))
    reset_tables()
    return out


def report_scheduling(res: dict[str, Any]) -> list[str]:
    s = res.get("scheduling", {})
    if not s:
        return []
    lines = ["6. Scheduling across runs (RQ)"]
    if m := s.get("many_runs"):
        lines.append(
            f"many runs: {m['runs']} runs x 10 x 100 ms, max_parallel=2, {m['threads']} threads: "
            f"effective concurrency {m['effective_concurrency']:.1f} (peak "
            f"{m['peak_concurrency']}) in {m['seconds']:.1f} s"
        )
    if t := s.get("tree"):
        lines.append(
            f"tree: parent max_parallel=4 over {t['children']} child runs: "
            f"{t['max_children_alive']} alive at once (parent {t['parent_status']})"
        )
    if h := s.get("hosts"):
        lines.append(
            f"per host: host_max_parallel=2, 2 hosts x 2 workers, {h['items']} x 50 ms: "
            f"{h['peak_concurrency']} at once, per host {h['peak_per_host']}"
        )
    return lines


# ------------------------------------------------------------- 7. consecutive runs, same workers


def phase_consecutive(cfg: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """Runs one after another on the same two long-lived workers, each run's rows kept, as users
    keep workers up for days and start run after run. Every other phase starts from empty
    tables, so it never sees a pick whose plan flips once the statistics lag behind the table.
    Each run is compared with a bare 2-transaction loop measured just before it."""
    n = cfg.consecutive_items
    runs: list[dict[str, Any]] = []
    with Workers(2, logdir) as pool:
        warm_up(pool)
        for r in range(cfg.consecutive_runs):
            bare = retry_db("consecutive/bare", partial(bare_once, n, 1, 2, two_tx=True))
            res = retry_db(
                "consecutive/rq2",
                lambda: one_run("bench.noop_each", n, "rq", None, pool, fresh=False),
            )
            res["bare_items_per_s"] = bare["items_per_s"]
            res["to_bare"] = res["items_per_s"] / bare["items_per_s"]
            runs.append(res)
            log(
                f"  consecutive #{r + 1}: {res['items_per_s']:,.0f} items/s, bare 2-tx loop "
                f"just before {bare['items_per_s']:,.0f}/s: {res['to_bare']:.2f} of it"
            )
    reset_tables()
    first = runs[0]["to_bare"]
    return {
        "items": n,
        "runs": runs,
        "slowest_to_first": min(r["to_bare"] for r in runs) / first,
    }


def report_consecutive(res: dict[str, Any]) -> list[str]:
    c = res.get("consecutive", {})
    if not c:
        return []
    lines = [
        f"7. Consecutive runs of {c['items']:,} per-item no-op items on the same 2 RQ workers, "
        "rows kept"
    ]
    for i, r in enumerate(c["runs"], 1):
        lines.append(
            f"run {i}: {r['items_per_s']:>7,.0f} items/s, {r['to_bare']:.2f} of the bare 2-tx "
            f"loop measured just before it ({r['bare_items_per_s']:,.0f}/s)"
        )
    ratio = c["slowest_to_first"]
    lines.append(f"slowest against the first, each to its own bare loop: {ratio:.2f}")
    return lines


# ------------------------------------------------------------------- 8. the admin's charts

CHART_LIFE = 3000  # seconds: the run ends now and began 50 minutes ago, so the pool's hour has it
CHART_POOL = "bench-charts"
POOL_HOUR = 3600  # seconds: the pool page's last hour


def chart_items_insert(n: int) -> str:
    """``INSERT … SELECT`` of n finished items of one run over CHART_LIFE seconds up to now:
    a tenth failed, one in seven on a second attempt, handler durations from 1 ms to 100 s."""
    from django.db import connection

    names = (
        "run_id key index pool status owner attempt crashes next_attempt_at error error_class "
        "claimed_at started_at finished_at"
    )
    columns = ", ".join(connection.ops.quote_name(c) for c in names.split())
    head = f"INSERT INTO fanout_itemclaim ({columns}) "
    if is_mariadb():
        took = "FLOOR(1000 * POW(10, (g.seq * 7919 %% 1000) / 200.0))"
        ended = f"TIMESTAMPADD(MICROSECOND, FLOOR(g.seq * {CHART_LIFE}e6 / {n}), %(start)s)"
        return (
            f"{head}SELECT %(run)s, CAST(g.seq AS CHAR), g.seq, %(pool)s, "
            "IF(g.seq %% 10 = 3, 'failed', 'succeeded'), 'bench', "
            "1 + (g.seq %% 7 = 0) + (g.seq %% 31 = 0), 0, %(start)s, '', '', "
            f"TIMESTAMPADD(MICROSECOND, -{took}, {ended}), "
            f"TIMESTAMPADD(MICROSECOND, -{took}, {ended}), {ended} "
            f"FROM seq_0_to_{n - 1} g"
        )
    return (
        f"{head}SELECT %(run)s, g::text, g, %(pool)s, "
        "CASE WHEN g %% 10 = 3 THEN 'failed' ELSE 'succeeded' END, 'bench', "
        "1 + (g %% 7 = 0)::int + (g %% 31 = 0)::int, 0, %(start)s, '', '', "
        "x.f - x.d, x.f - x.d, x.f "
        "FROM generate_series(0, %(last)s) g, LATERAL (SELECT "
        f"%(start)s::timestamptz + make_interval(secs => g::float8 * {CHART_LIFE} / %(n)s) AS f, "
        "make_interval(secs => 0.001 * power(10, (g::bigint * 7919 %% 1000) / 200.0)) AS d) x"
    )


def chart_run(n: int) -> tuple[int, int]:
    """A finished run of n items (and a sample every 10 s of its waits and of the items that
    ended), and its pool (with a sample every 10 s of its admissions)."""
    from datetime import timedelta

    from django.db import connection
    from django.utils import timezone

    from fanout.models import BatchRun, CapacityPool, PoolSample, RunSample
    from fanout.sample import admitted, tally

    now = timezone.now()
    start = now - timedelta(seconds=CHART_LIFE)
    pool, _ = CapacityPool.objects.get_or_create(
        name=CHART_POOL, defaults={"max_concurrency": 64, "rate_count": 500}
    )
    run = BatchRun.objects.create(
        definition="bench.charts",
        run_key=run_key("charts"),
        status="succeeded",
        max_parallel=64,
        failure_policy="collect",
        join_mode="all",
        total_items=n,
        materialized_upto=n,
        created_at=start,
        started_at=start,
        finished_at=now,
    )
    with connection.cursor() as cur:
        cur.execute(
            chart_items_insert(n),
            {"run": run.pk, "pool": CHART_POOL, "start": start, "last": n - 1, "n": n},
        )
    analyze()
    # As the supervisor samples a running run: what waited, and the items that ended in the
    # window up to 10 s before (fanout.sample.tally, the same query).
    samples, since = [], None
    for s in range(10, CHART_LIFE, 10):
        sample = RunSample(
            run=run,
            at=start + timedelta(seconds=s),
            running=40 + s % 24,
            pool_full=(s * 37) % 500,
            rate_limited=(s * 11) % 300,
            retry_due=s % 50,
        )
        tally(sample, run, since, sample.at - timedelta(seconds=10))
        samples.append(sample)
        since = sample.upto
    RunSample.objects.bulk_create(samples)
    # As the supervisor samples the pool: a window every 10 s since before the pool page's
    # hour, each counting the items claimed in it (fanout.sample.admitted, the same query).
    windows, since = [], None
    for s in range(-POOL_HOUR - 60, 1, 10):
        at = now + timedelta(seconds=s)
        upto = at - timedelta(seconds=10)
        since = since or upto - timedelta(seconds=10)
        windows.append(
            PoolSample(
                pool=pool,
                at=at,
                in_flight=40 + s % 24,
                since=since,
                upto=upto,
                admitted=admitted(pool.name, since, upto),
            )
        )
        since = upto
    PoolSample.objects.bulk_create(windows)
    analyze()
    return run.pk, pool.pk


def timed_page(client: Any, url: str) -> dict[str, Any]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    t0 = time.perf_counter()
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    seconds = time.perf_counter() - t0
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}")
    slowest = max((float(q["time"]) for q in captured.captured_queries), default=0.0)
    return {"seconds": seconds, "queries": len(captured), "slowest_query_s": slowest}


def timed_count(run_id: int) -> dict[str, Any]:
    """The floor of any page that reads every item: a bare count of the run's items."""
    from django.db import connection

    t0 = time.perf_counter()
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM fanout_itemclaim WHERE run_id = %s", [run_id])
        cur.fetchone()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "queries": 1, "slowest_query_s": seconds}


def phase_charts(cfg: argparse.Namespace) -> dict[str, Any]:
    """Time the run page (its charts cold, then cached) and the pool page at cfg.chart_items
    finished items, best of the repeats: the charts read them with SQL aggregates."""
    from django.contrib.auth import get_user_model
    from django.core.cache import cache
    from django.test import Client
    from django.urls import reverse

    reset_tables()
    n = cfg.chart_items
    t0 = time.monotonic()
    run_id, pool_id = retry_db("charts rows", partial(chart_run, n))
    log(f"  {n:,} items written in {time.monotonic() - t0:.1f} s")
    user, _ = get_user_model().objects.get_or_create(
        username="bench-charts", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    run_url = reverse("admin:fanout_batchrun_change", args=[run_id])
    pool_url = reverse("admin:fanout_capacitypool_change", args=[pool_id])
    client.get(pool_url)  # the session, templates and the tables' pages warmed alike
    found: dict[str, list[dict[str, Any]]] = {
        "run_cold": [],
        "run_cached": [],
        "pool": [],
        "count": [],
    }
    for r in range(cfg.repeats):
        found["count"].append(timed_count(run_id))
        cache.clear()
        found["run_cold"].append(timed_page(client, run_url))
        found["run_cached"].append(timed_page(client, run_url))
        found["pool"].append(timed_page(client, pool_url))
        log(
            "  #{} count(*) {:.3f} s; run page {:.3f} s cold ({} queries), {:.3f} s cached; "
            "pool page {:.3f} s".format(
                r + 1,
                found["count"][-1]["seconds"],
                found["run_cold"][-1]["seconds"],
                found["run_cold"][-1]["queries"],
                found["run_cached"][-1]["seconds"],
                found["pool"][-1]["seconds"],
            )
        )
    # The same pool page without its samples: drawn from the items, as before them.
    from fanout.models import PoolSample

    PoolSample.objects.all().delete()
    found["pool_items"] = []
    for r in range(cfg.repeats):
        found["pool_items"].append(timed_page(client, pool_url))
        log(
            f"  #{r + 1} pool page from its items (samples deleted) "
            f"{found['pool_items'][-1]['seconds']:.3f} s"
        )
    reset_tables()
    out: dict[str, Any] = {
        "items": n,
        "cold_to_count": stats(
            [
                cold["seconds"] / count["seconds"]
                for cold, count in zip(found["run_cold"], found["count"], strict=True)
            ]
        ),
    }
    for page, runs in found.items():
        out[page] = {
            "seconds": stats([x["seconds"] for x in runs]),
            "queries": runs[-1]["queries"],
            "slowest_query_s": stats([x["slowest_query_s"] for x in runs]),
        }
    return out


def report_charts(res: dict[str, Any]) -> list[str]:
    ch = res.get("charts", {})
    if not ch:
        return []
    lines = [
        f"8. The admin's pages with their charts, {ch['items']:,} finished items of one run "
        "(median of repeats)",
        f"{'page':>24}{'seconds':>9}{'min–max':>16}{'queries':>9}{'slowest query':>15}",
    ]
    s3 = lambda x: f"{x:.3f}"  # noqa: E731
    names = {
        "count": "count(*) of its items",
        "run_cold": "run page, cold",
        "run_cached": "run page, cached",
        "pool": "pool page",
        "pool_items": "pool page, from items",
    }
    for key, name in names.items():
        if key not in ch:
            continue
        v = ch[key]
        lines.append(
            f"{name:>24}{v['seconds']['median']:>9.3f}{fmt_span(v['seconds'], s3):>16}"
            f"{v['queries']:>9}{v['slowest_query_s']['median']:>15.3f}"
        )
    ratios = ch.get("cold_to_count")
    if ratios and ratios["median"] is not None:
        lines.append(
            f"run page cold / count(*) of its items, per repeat: {ratios['median']:.2f} "
            f"({fmt_span(ratios, lambda x: f'{x:.2f}')})"
        )
    return lines


# ------------------------------------------------------------- 9. retention beside a live run


def claim_loop(samples: int, warmup: int = 20) -> dict[str, Any]:
    """A per-item run drained by one claimer: claim one item, record it, ``samples`` times;
    its items per second (claim and record) and its claim latencies."""
    from fanout.claim import claim
    from fanout.definition import get_definition
    from fanout.dispatch import prepare_run
    from fanout.record import SUCCEEDED, ExecutionOutcome, record

    definition = get_definition("bench.noop_each")
    run = prepare_run(definition, {"n": samples + warmup}, run_key("retention"))
    times = []
    started = 0.0
    for i in range(samples + warmup):
        if i == warmup:
            started = time.perf_counter()
        t0 = time.perf_counter()
        res = claim(run.pk, "bench-claimer", 1, 30.0, 3, None)
        dt = time.perf_counter() - t0
        if len(res.items) != 1:
            raise RuntimeError(f"claim {i} got {len(res.items)} items: {res.reason}")
        item = res.items[0]
        record(run.pk, res.token, [ExecutionOutcome(item.pk, item.key, SUCCEEDED)], "collect")
        if i >= warmup:
            times.append(dt)
    return {"times": times, "seconds": time.perf_counter() - started}


def claims_summary(loops: list[dict[str, Any]]) -> dict[str, Any]:
    times = [t for loop in loops for t in loop["times"]]
    seconds = sum(loop["seconds"] for loop in loops)
    return {
        "claims": len(times),
        "items_per_s": len(times) / seconds,
        "median_ms": statistics.median(times) * 1000,
        "p99_ms": percentile(times, 99) * 1000,
    }


def prune_beside(cfg: argparse.Namespace, batch: int, pause: float, logdir: Path) -> dict[str, Any]:
    """Fill cfg.retention_rows finished item rows, then prune them with ``manage.py
    fanout_prune`` in a subprocess while the claim loop drains a run beside it. The loop runs
    alone too, in turns with the loop beside the prune: the prune is stopped (SIGSTOP) between
    two of its transactions while the loop runs alone, so that the two are measured under the
    same load of a shared machine. The fill has settled first (its rows vacuumed, a
    checkpoint): what it leaves to do is not counted against the prune."""
    add_terminal_rows(cfg.retention_rows)
    settle()
    log_path = logdir / f"prune-{batch}-{pause:g}.log"
    cmd = [sys.executable, "manage.py", "fanout_prune", "--older-than", "0s", "--batch", str(batch)]
    cmd += ["--pause", f"{pause:g}", "--json"]
    t0 = time.monotonic()
    proc = spawn(cmd, log_path)
    loops, alone, stopped = [], [], 0.0
    try:
        while proc.poll() is None:
            loops.append(claim_loop(cfg.retention_chunk, warmup=2))
            t_stop = time.monotonic()
            if not freeze(proc):
                break  # it ended
            try:
                alone.append(claim_loop(cfg.retention_chunk, warmup=2))
            finally:
                os.kill(proc.pid, signal.SIGCONT)
                stopped += time.monotonic() - t_stop
        proc.wait()
    finally:
        _stop_process(proc)
        if proc in _children:
            _children.remove(proc)
    seconds = time.monotonic() - t0 - stopped
    if proc.returncode != 0 or not loops:
        raise RuntimeError(f"fanout_prune exited {proc.returncode}: {log_path.read_text()[-800:]}")
    report = json.loads(log_path.read_text().strip().splitlines()[-1])
    return {
        "batch": batch,
        "pause": pause,
        "rows": report["items"],
        "prune_s": seconds,
        "rows_per_s": report["items"] / seconds,
        **claims_summary(loops),
        "interleaved": alone,
    }


def freeze(proc: subprocess.Popen) -> bool:
    """Stop the prune while it rests between two transactions (a stopped transaction would
    hold its locks); False if it ended first."""
    while proc.poll() is None:
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.05)  # a statement it sent just before has begun by now
        if not prune_in_transaction():
            return True
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.02)
    return False


def prune_in_transaction() -> bool:
    """Whether another connection to the bench database (the prune's) is in a transaction."""
    from django.db import connection

    with connection.cursor() as cur:
        if is_mariadb():
            cur.execute(
                "SELECT count(*) FROM information_schema.innodb_trx t "
                "JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id "
                "WHERE p.db = DATABASE() AND p.id <> CONNECTION_ID()"
            )
        else:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
                "AND state <> 'idle'"
            )
        return bool(cur.fetchone()[0])


def settle() -> None:
    """Vacuum and analyze the items just written and checkpoint: on PostgreSQL the first
    reads of fresh rows write their hint bits, and their WAL brings a checkpoint."""
    from django.db import connection

    with connection.cursor() as cur:
        if is_mariadb():
            cur.execute("ANALYZE TABLE fanout_itemclaim, fanout_batchrun")
            cur.fetchall()
            return
        cur.execute("VACUUM (ANALYZE) fanout_itemclaim")
        cur.execute("VACUUM (ANALYZE) fanout_batchrun")
        cur.execute("CHECKPOINT")


def phase_retention(cfg: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """A prune of cfg.retention_rows finished item rows beside a per-item run: its rows per
    second, and the run's throughput and claim p99 against the same loop with no prune
    beside it, measured in turns with it (the load of a shared machine drifts)."""
    reset_tables()
    out: dict[str, Any] = {"rows": cfg.retention_rows, "pruned": []}
    tries = [(b, p) for b in cfg.retention_batches for p in cfg.retention_pauses]
    for batch, pause in tries:
        beside = retry_db("retention", partial(prune_beside, cfg, batch, pause, logdir))
        # A prune that ended before the loop had its turn alone: alone just after it.
        base = claims_summary(beside.pop("interleaved") or [claim_loop(cfg.retention_alone)])
        beside["p99_ratio"] = beside["p99_ms"] / base["p99_ms"]
        beside["throughput_ratio"] = base["items_per_s"] / beside["items_per_s"]
        beside["alone"] = base
        out["pruned"].append(beside)
        log(
            f"  batch {batch}, pause {pause:g} s: {beside['rows']:,} rows in "
            f"{beside['prune_s']:.1f} s = "
            f"{beside['rows_per_s']:,.0f} rows/s; beside it {beside['items_per_s']:,.0f} "
            f"items/s, claim p99 {beside['p99_ms']:.2f} ms; alone {base['items_per_s']:,.0f} "
            f"items/s, p99 {base['p99_ms']:.2f} ms (p99 x{beside['p99_ratio']:.2f}, "
            f"throughput /{beside['throughput_ratio']:.2f})"
        )
    reset_tables()
    return out


def report_retention(res: dict[str, Any]) -> list[str]:
    rt = res.get("retention", {})
    if not rt:
        return []
    lines = [
        f"9. fanout_prune of {rt['rows']:,} finished item rows beside a per-item run "
        "(one claimer), against the same run alone in turns with it (the prune stopped)",
        f"{'batch':>7}{'pause':>7}{'rows/s':>10}{'items/s beside':>16}{'alone':>8}"
        f"{'claim p99 beside':>18}"
        f"{'alone':>8}{'p99 ratio':>11}{'slowdown':>10}",
    ]
    for v in rt["pruned"]:
        lines.append(
            f"{v['batch']:>7,}{v.get('pause', 0):>6g}s{v['rows_per_s']:>10,.0f}"
            f"{v['items_per_s']:>16,.0f}"
            f"{v['alone']['items_per_s']:>8,.0f}{v['p99_ms']:>16.2f}ms"
            f"{v['alone']['p99_ms']:>6.2f}ms{v['p99_ratio']:>11.2f}{v['throughput_ratio']:>10.2f}"
        )
    return lines


# ------------------------------------------------------------------------------ the report


def fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def fmt_span(s: dict, f: Callable[[float], str] = fmt_rate) -> str:
    if s.get("median") is None:
        return "-"
    return f"{f(s['min'])}–{f(s['max'])}"


def median(entry: dict[str, Any] | None, field: str = "items_per_s") -> float | None:
    return ((entry or {}).get(field) or {}).get("median")


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target as a row, measured or not (a phase that failed or was skipped: n/a)."""
    t: list[dict[str, Any]] = []

    def add(
        name: str, value: Any, goal: str, test: Callable[[Any], bool], unit: str, source: str
    ) -> None:
        met = None if value is None else bool(test(value))
        t.append(
            {
                "target": name,
                "value": value,
                "goal": goal,
                "met": met,
                "unit": unit,
                "source": source,
            }
        )

    def info(name: str, value: Any, unit: str = "ratio") -> None:
        if value is not None:
            t.append(
                {
                    "target": name,
                    "value": value,
                    "goal": "info",
                    "met": None,
                    "unit": unit,
                    "source": "",
                }
            )

    pi, tp, base = res.get("per_item", {}), res.get("throughput", {}), res.get("baseline", {})
    pools = res.get("pools", {})
    sched = res.get("scheduling", {})
    add(
        "consecutive runs on the same workers: slowest / first, each to its bare loop",
        res.get("consecutive", {}).get("slowest_to_first"),
        ">= 0.9",
        lambda v: v >= 0.9,
        "ratio",
        "issue 19",
    )
    add(
        "many runs: effective handler concurrency, 24 runs x max_parallel=2 on 16 threads",
        sched.get("many_runs", {}).get("effective_concurrency"),
        ">= 12",
        lambda v: v >= 12,
        "threads",
        "issue 21",
    )
    add(
        "tree: child runs alive at once under a parent with max_parallel=4",
        sched.get("tree", {}).get("max_children_alive"),
        "== 4",
        lambda v: v == 4,
        "runs",
        "issue 21",
    )
    hosts = sched.get("hosts", {})
    add(
        "per host: items at once, host_max_parallel=2 on 2 hosts",
        hosts.get("peak_concurrency"),
        "== 4",
        lambda v: v == 4,
        "items",
        "issue 21",
    )
    add(
        "per host: most items at once on one host",
        max(hosts["peak_per_host"].values()) if hosts.get("peak_per_host") else None,
        "<= 2",
        lambda v: v <= 2,
        "items",
        "issue 21",
    )
    add(
        "per-item commit, RQ 2 workers / bare 2-tx loop, 2 connections",
        median(pi, "ratio_rq2_to_bare_2tx_2conn"),
        ">= 0.80",
        lambda v: v >= 0.8,
        "ratio",
        "issue 10",
    )
    add(
        "per-item commit, RQ 2 workers / RQ 1 worker",
        median(pi, "ratio_rq2_to_rq1"),
        ">= 1.50",
        lambda v: v >= 1.5,
        "ratio",
        "issue 10",
    )
    each2 = median(pi.get("per_item_commit/rq2"))
    bare1, bare2 = median(base.get("bare_1_per_tx")), median(base.get("bare_1_per_tx_2conn"))
    info("  (info) per-item commit, RQ 2 workers, items/s", each2, "items/s")
    info(
        "  (info) bare 2-tx loop, 2 connections, items/s",
        median(pi.get("bare_2tx_2conn")),
        "items/s",
    )
    if each2 and bare2:
        info(
            "  (info) per-item commit, RQ 2 workers / bare 1-tx loop, 2 connections", each2 / bare2
        )
    if each2 and bare1:
        info("  (info) per-item commit, RQ 2 workers / bare 1-tx loop, 1 connection", each2 / bare1)
    slow = pi.get("sleep20ms/rq2", {})
    add(
        "20 ms items, max_parallel 16, RQ 2 workers: share of 800 items/s",
        median(slow, "fraction_of_limit"),
        ">= 80%",
        lambda v: v >= 0.8,
        "fraction",
        "issue 10",
    )
    add(
        "20 ms items, max_parallel 16, RQ 2 workers: at most 16 at once",
        None if not slow else not slow["exceeded"],
        "never above",
        bool,
        "bool",
        "issue 10",
    )
    threads = res["config"]["pool_threads"]
    for key in ("concurrency4_50ms/rq2", f"concurrency4_50ms/inline{threads}"):
        p = pools.get(key, {})
        who = "RQ 2 workers" if key.endswith("rq2") else f"inline {threads} threads"
        add(
            f"pool of 4, 50 ms items, {who}: share of 80 items/s",
            median(p, "fraction_of_limit"),
            ">= 95%",
            lambda v: v >= 0.95,
            "fraction",
            "issue 10",
        )
        add(
            f"pool of 4, 50 ms items, {who}: at most 4 at once",
            None if not p else not p["exceeded"],
            "never above",
            bool,
            "bool",
            "issue 10",
        )
    add(
        "no-op in batches of 200, RQ 2 workers, items/s",
        median(tp.get("noop/rq2")),
        ">= 10,000",
        lambda v: v >= 10_000,
        "items/s",
        "issue 10",
    )
    batched, bare100 = median(tp.get("noop/rq2")), median(base.get("bare_100_per_tx"))
    add(
        "no-op in batches of 200, RQ 2 workers / bare 100/tx loop",
        batched / bare100 if batched and bare100 else None,
        ">= 0.50",
        lambda v: v >= 0.5,
        "ratio",
        "issue 19",
    )
    server = result_cpu_fields(res)[1]
    add(
        "per-item commit, RQ 2 workers: database CPU ms/item",
        median(pi.get("per_item_commit/rq2"), server),
        "<= 0.25",
        lambda v: v <= 0.25,
        "ms",
        "issue 19",
    )
    for label, v in carried(res).items():
        info(f"  (info) {label}: items/s per database core", v["items_per_s_per_core"], "items/s")
    cl = {k: v for k, v in res.get("claims", {}).items() if k.isdigit()}
    if cl:
        lo, hi = cl[str(min(int(k) for k in cl))], cl[str(max(int(k) for k in cl))]
        claim_name = (
            f"claim p99 at {hi['terminal_rows']:,} / at {lo['terminal_rows']:,} terminal rows"
        )
    else:
        claim_name = "claim p99 at 1,000,000 / at 10,000 terminal rows"
    # The median over repeats of each repeat's own ratio (levels measured side by side).
    add(
        claim_name,
        median(res.get("claims"), "p99_ratio_largest_to_smallest"),
        "<= 2.0",
        lambda v: v <= 2.0,
        "ratio",
        "issue 10",
    )
    mat = res.get("materialize", {})
    for size, m in mat.items():
        add(
            f"materialization {int(size):,} items, items/s",
            median(m),
            ">= 50,000",
            lambda v: v >= 50_000,
            "items/s",
            "issue 7",
        )
    if mat:
        big = mat[str(max(int(k) for k in mat))]
        add(
            f"materialization {big['items']:,} items, peak RSS MB (max)",
            big["peak_rss_mb"]["max"],
            "< 200",
            lambda v: v < 200,
            "MB",
            "issue 7",
        )
    rate = pools.get("rate50/inline", {})
    add(
        "pool rated 50/s (burst 5), inline 8 threads: share of the rate",
        median(rate, "fraction_of_limit"),
        ">= 90%",
        lambda v: v >= 0.9,
        "fraction",
        "issue 7",
    )
    add(
        "pool rated 50/s (burst 5): never above the bucket's bound",
        None if not rate else not rate["exceeded"],
        "never above",
        bool,
        "bool",
        "issue 7",
    )
    return t


def fmt_value(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "bool":
        return "yes" if v else "NO"
    if unit == "fraction":
        return f"{v:.1%}"
    if unit == "count":
        return f"{v:,}"
    if unit in ("items/s", "MB") and v >= 100:
        return f"{v:,.0f}"
    return f"{v:,.2f}"


def cores(entry: dict[str, Any]) -> str:
    """Cores the measured processes kept busy / cores the whole machine kept busy (medians)."""
    ours, busy = median(entry, "our_cores"), median(entry, "busy_cores")
    return "-" if ours is None or busy is None else f"{ours:.2f}/{busy:.2f}"


def on_mariadb(res: dict[str, Any]) -> bool:
    return res.get("database") == "mariadb"


def result_cpu_fields(res: dict[str, Any]) -> tuple[str, ...]:
    server = "mariadb" if on_mariadb(res) else "postgres"
    return ("cpu_ms_per_item", f"{server}_cpu_ms_per_item", "our_cores", "busy_cores")


def report_per_item(res: dict[str, Any]) -> list[str]:
    pi = res.get("per_item", {})
    if not pi:
        return []
    bare = median(pi.get("bare_2tx_2conn"))
    server = "DB CPU" if on_mariadb(res) else "PG CPU"
    lines = [
        "1. Per-item commit (batch_size unset = 1), RQ workers with FANOUT_WORKER_THREADS="
        f"{pi['worker_threads']} and default drain jobs, start → join; bare loop beside it",
        f"{'':<44}{'items':>7}{'items/s':>9}{'min–max':>14}{'÷2-tx':>7}"
        f"{'client CPU':>11}{server:>8}{'cores':>11}",
        f"{'':<44}{'':>7}{'':>9}{'':>14}{'':>7}{'ms/item':>11}{'ms/item':>8}{'ours/busy':>11}",
    ]
    rows = [
        ("per-item commit, RQ 1 worker", pi["per_item_commit/rq1"]),
        ("bare 2-tx loop, 2 connections", pi["bare_2tx_2conn"]),
        ("per-item commit, RQ 2 workers", pi["per_item_commit/rq2"]),
        ("20 ms, max_parallel 16, RQ 2 workers", pi["sleep20ms/rq2"]),
    ]
    for label, v in rows:
        s = v["items_per_s"]
        ratio = "-" if not bare or label.startswith("20 ms") else f"{s['median'] / bare:.2f}"
        client, pg = (median(v, k) for k in result_cpu_fields(res)[:2])
        shown = [f"{x:.2f}" if x is not None else "-" for x in (client, pg)]
        lines.append(
            f"{label:<44}{v['items']:>7,}{fmt_rate(s['median']):>9}{fmt_span(s):>14}{ratio:>7}"
            f"{shown[0]:>11}{shown[1]:>8}{cores(v):>11}"
        )
    slow = pi["sleep20ms/rq2"]
    f = slow["fraction_of_limit"]
    lines.append(
        f"20 ms items: {f['median']:.1%} of {slow['limit']} "
        f"({fmt_span(f, lambda x: f'{x:.1%}')}); at most {slow['max_in_flight']} handlers at once"
    )
    two = lambda x: f"{x:.2f}"  # noqa: E731
    a, b = pi["ratio_rq2_to_bare_2tx_2conn"], pi["ratio_rq2_to_rq1"]
    lines.append(
        f"per repeat: RQ 2 workers / bare 2-tx loop {a['median']:.2f} ({fmt_span(a, two)}); "
        f"RQ 2 workers / RQ 1 worker {b['median']:.2f} ({fmt_span(b, two)})"
    )
    return lines


def report_throughput(res: dict[str, Any]) -> list[str]:
    base = dict(res.get("baseline", {}))
    if "bare_2tx_2conn" in res.get("per_item", {}):
        base = {"bare_2tx_2conn": res["per_item"]["bare_2tx_2conn"], **base}
    tp = res.get("throughput", {})
    if not tp and not base:
        return []
    bare2tx = median(base.get("bare_2tx_2conn"))
    bare100 = median(base.get("bare_100_per_tx"))

    def ratio(v: float | None, b: float | None) -> str:
        return "-" if not v or not b else f"{v / b:.2f}"

    server = "DB CPU" if on_mariadb(res) else "PG CPU"
    lines = [
        f"2. Batched throughput, start → join (median of {res['config']['repeats']}), "
        f"and the bare {'MySQLdb' if on_mariadb(res) else 'psycopg'} claim loops",
        f"{'':<44}{'items':>9}{'items/s':>10}{'min–max':>18}{'÷2-tx':>8}{'÷bare100':>9}"
        f"{'client CPU':>11}{server:>8}{'cores':>11}",
        f"{'':<44}{'':>9}{'':>10}{'':>18}{'':>8}{'':>9}{'ms/item':>11}{'ms/item':>8}"
        f"{'ours/busy':>11}",
    ]
    rows = []
    for key, v in tp.items():
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
        kind = "2-tx loop" if v.get("transactions_per_item") == 2 else f"loop, {v['batch']}/tx"
        rows.append((f"bare {kind}{conn}", v))
    for label, v in rows:
        s = v["items_per_s"]
        client, db = (median(v, k) for k in result_cpu_fields(res)[:2])
        shown = [f"{x:.3f}" if x is not None else "-" for x in (client, db)]
        lines.append(
            f"{label:<44}{v['items']:>9,}{fmt_rate(s['median']):>10}"
            f"{fmt_span(s):>18}{ratio(s['median'], bare2tx):>8}"
            f"{ratio(s['median'], bare100):>9}{shown[0]:>11}{shown[1]:>8}{cores(v):>11}"
        )
    return lines


# What one database carries: the server's CPU per item of each mode, as items/s per core.
CARRIED = (
    ("per-item commit, RQ 2 workers", "per_item", "per_item_commit/rq2"),
    ("bare 2-tx loop, 2 connections", "per_item", "bare_2tx_2conn"),
    ("no-op in batches of 200, RQ 2 workers", "throughput", "noop/rq2"),
    ("bare loop, 100/tx", "baseline", "bare_100_per_tx"),
)


def carried(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per mode, the database server's CPU per item (median, ms) and what a core of it
    carries at that cost: 1000 / ms items/s, for every worker of a fleet together."""
    field = result_cpu_fields(res)[1]
    out: dict[str, dict[str, float]] = {}
    for label, phase, key in CARRIED:
        ms = median(res.get(phase, {}).get(key), field)
        if ms:
            out[label] = {"server_cpu_ms_per_item": ms, "items_per_s_per_core": 1000 / ms}
    return out


def report_carried(res: dict[str, Any]) -> list[str]:
    rows = res.get("carried") or carried(res)
    if not rows:
        return []
    name = "MariaDB" if on_mariadb(res) else "PostgreSQL"
    lines = [
        f"2b. What one database carries: {name} CPU per item, and items/s one core of it "
        "keeps up with (every worker of a fleet together; the bare loops for scale)",
        f"{'':<44}{'ms/item':>9}{'items/s per core':>18}",
    ]
    for label, v in rows.items():
        lines.append(
            f"{label:<44}{v['server_cpu_ms_per_item']:>9.3f}{v['items_per_s_per_core']:>18,.0f}"
        )
    return lines


def report_materialize(res: dict[str, Any]) -> list[str]:
    mat = res.get("materialize", {})
    if not mat:
        return []
    lines = [
        "3. Materialization (separate process)",
        f"{'items':>12}{'items/s':>10}{'min–max':>18}{'peak RSS MB':>13}"
        f"{'min–max':>12}{'after setup':>13}",
    ]
    for v in mat.values():
        s, m = v["items_per_s"], v["peak_rss_mb"]
        lines.append(
            f"{v['items']:>12,}{fmt_rate(s['median']):>10}{fmt_span(s):>18}"
            f"{m['median']:>13.0f}{fmt_span(m, lambda x: f'{x:.0f}'):>12}"
            f"{v['rss_after_setup_mb']['median']:>13.0f}"
        )
    return lines


def report_claims(res: dict[str, Any]) -> list[str]:
    cl = res.get("claims", {})
    if not cl:
        return []
    lines = [
        "4. One claim transaction (fanout.claim.claim, 1 item) vs terminal rows of other runs, ms",
        f"{'terminal rows':>14}{'median':>9}{'min–max':>14}{'p99':>9}{'min–max':>14}",
    ]
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
    return lines


def report_pools(res: dict[str, Any]) -> list[str]:
    pools = res.get("pools", {})
    if not pools:
        return []
    lines = ["5. Pool-limited runs, start → join"]
    pct = lambda x: f"{x:.1%}"  # noqa: E731
    for key, v in pools.items():
        s, f = v["items_per_s"], v["fraction_of_limit"]
        if "max_in_flight" in v:
            extra = (
                f"{median(v, 'fraction_of_limit_handlers_span'):.1%} from the first handler to "
                f"the last; max in flight {v['max_in_flight']}"
            )
        else:
            extra = (
                f"max {v['max_admissions_in_1s']} admissions in any 1 s (the bucket allows "
                f"{v['burst'] + v['limit_items_per_s']:g})"
            )
        lines.append(
            f"{key:<24} limit {v['limit']}: {s['median']:.1f} items/s "
            f"({fmt_span(s, lambda x: f'{x:.1f}')}), {f['median']:.1%} of the limit "
            f"({fmt_span(f, pct)}); {extra}; {'EXCEEDED' if v['exceeded'] else 'never above'}"
        )
    return lines


def beside_rows(pg: dict[str, Any], maria: dict[str, Any]) -> list[tuple[str, str, Callable]]:
    """(label, unit, value of one pass's results) for every figure the two passes share."""

    def at(phase: str, key: str, field: str = "items_per_s") -> Callable:
        return lambda r: median(r.get(phase, {}).get(key), field)

    def quotient(a: Callable, b: Callable) -> Callable:
        return lambda r: a(r) / b(r) if a(r) and b(r) else None

    def server_cpu(r: dict[str, Any]) -> float | None:
        return at("per_item", "per_item_commit/rq2", result_cpu_fields(r)[1])(r)

    rq1, rq2 = at("per_item", "per_item_commit/rq1"), at("per_item", "per_item_commit/rq2")
    rows: list[tuple[str, str, Callable]] = [
        ("per-item commit, RQ 1 worker, items/s", "items/s", rq1),
        ("per-item commit, RQ 2 workers, items/s", "items/s", rq2),
        ("bare 2-tx loop, 2 connections, items/s", "items/s", at("per_item", "bare_2tx_2conn")),
        (
            "per-item commit, RQ 2 workers / bare 2-tx loop",
            "ratio",
            lambda r: median(r.get("per_item"), "ratio_rq2_to_bare_2tx_2conn"),
        ),
        (
            "per-item commit, RQ 2 workers / RQ 1 worker",
            "ratio",
            lambda r: median(r.get("per_item"), "ratio_rq2_to_rq1"),
        ),
        (
            "per-item commit, RQ 2 workers: client CPU ms/item",
            "ms",
            at("per_item", "per_item_commit/rq2", "cpu_ms_per_item"),
        ),
        ("per-item commit, RQ 2 workers: server CPU ms/item", "ms", server_cpu),
        (
            "20 ms, max_parallel 16, RQ 2 workers, items/s",
            "items/s",
            at("per_item", "sleep20ms/rq2"),
        ),
        (
            "20 ms, max_parallel 16, RQ 2 workers: share of 800/s",
            "fraction",
            at("per_item", "sleep20ms/rq2", "fraction_of_limit"),
        ),
        (
            "20 ms, max_parallel 16: most handlers at once",
            "count",
            lambda r: r.get("per_item", {}).get("sleep20ms/rq2", {}).get("max_in_flight"),
        ),
    ]
    for key in dict.fromkeys([*pg.get("throughput", {}), *maria.get("throughput", {})]):
        v = pg.get("throughput", {}).get(key) or maria["throughput"][key]
        label, plural = key.split("/")[0], "s" if v["workers"] > 1 else ""
        who = (
            f"RQ {v['workers']} worker{plural}"
            if v["executor"] == "rq"
            else f"inline {v['workers']} thread{plural}"
        )
        rows.append(
            (f"{label} (batch {v['batch_size']}), {who}, items/s", "items/s", at("throughput", key))
        )
    noop1, noop2 = at("throughput", "noop/rq1"), at("throughput", "noop/rq2")
    rows.append(("noop (batch 200), RQ 2 workers / RQ 1 worker", "ratio", quotient(noop2, noop1)))
    for key, label in (
        ("bare_1_per_tx", "bare loop, 1/tx"),
        ("bare_1_per_tx_2conn", "bare loop, 1/tx, 2 conns"),
        ("bare_100_per_tx", "bare loop, 100/tx"),
    ):
        rows.append((f"{label}, items/s", "items/s", at("baseline", key)))
    rows.append(
        (
            "noop (batch 200), RQ 2 workers / bare 100/tx loop",
            "ratio",
            quotient(noop2, at("baseline", "bare_100_per_tx")),
        )
    )
    for size in dict.fromkeys([*pg.get("materialize", {}), *maria.get("materialize", {})]):
        rows.append(
            (f"materialization {int(size):,} items, items/s", "items/s", at("materialize", size))
        )
        rows.append(
            (
                f"materialization {int(size):,} items, peak RSS MB",
                "MB",
                at("materialize", size, "peak_rss_mb"),
            )
        )
    levels = sorted(
        int(k) for k in {**pg.get("claims", {}), **maria.get("claims", {})} if k.isdigit()
    )
    rows.append(
        (
            f"claim p99 at {levels[-1]:,} / at {levels[0]:,} terminal rows"
            if levels
            else "claim p99, largest / smallest terminal rows",
            "ratio",
            lambda r: median(r.get("claims"), "p99_ratio_largest_to_smallest"),
        )
    )
    for key in dict.fromkeys([*pg.get("pools", {}), *maria.get("pools", {})]):
        rows.append(
            (f"pool {key}: share of the limit", "fraction", at("pools", key, "fraction_of_limit"))
        )
    return rows


def report_mariadb(res: dict[str, Any]) -> list[str]:
    """Each figure on PostgreSQL and on MariaDB, and MariaDB's over PostgreSQL's."""
    maria = res.get("mariadb")
    if maria is None:
        skipped = any(w.startswith("no MariaDB figures") for w in res.get("warnings", []))
        return (
            ["MariaDB beside PostgreSQL: not measured (see the WARNING below)"] if skipped else []
        )
    lines = [
        "MariaDB beside PostgreSQL (the MariaDB pass ran after the PostgreSQL one, on the same "
        "machine; ratios of items/s above 1: faster on MariaDB)",
        f"{'':<56}{'PostgreSQL':>12}{'MariaDB':>12}{'MariaDB/PG':>12}",
    ]
    for label, unit, get in beside_rows(res, maria):
        a, b = get(res), get(maria)
        if a is None and b is None:
            continue
        ratio = f"{b / a:.2f}" if a and b is not None and unit != "count" else "-"
        shown = [("n/a" if x is None else fmt_value(x, unit)) for x in (a, b)]
        lines.append(f"{label:<56}{shown[0]:>12}{shown[1]:>12}{ratio:>12}")
    info = maria.get("machine", {})
    if info.get("mariadb"):
        lines.append(
            f"MariaDB {info['mariadb']}, innodb_flush_log_at_trx_commit "
            f"{info.get('mariadb_flush_log_at_trx_commit')}, sync_binlog "
            f"{info.get('mariadb_sync_binlog')}; PostgreSQL {res['machine'].get('postgresql')}, "
            f"synchronous_commit {res['machine'].get('pg_synchronous_commit')}"
        )
    met = [t for t in maria.get("targets", []) if t["goal"] != "info" and t["met"] is not None]
    if met:
        lines.append(
            f"MariaDB's own targets: {sum(t['met'] for t in met)} of {len(met)} met "
            "(the JSON's mariadb.targets)"
        )
    return lines


def report_targets(res: dict[str, Any]) -> list[str]:
    lines = ["Targets"]
    for t in res.get("targets", []):
        shown = fmt_value(t["value"], t["unit"])
        if t["goal"] == "info":
            lines.append(f"  {t['target']:<70}{shown:>10}")
            continue
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT MET")
        lines.append(f"  {t['target']:<70}{shown:>10}  ({t['goal']}): {met}  [{t['source']}]")
    return lines


def print_report(res: dict[str, Any]) -> None:
    sections = [
        report_per_item(res),
        report_throughput(res),
        report_carried(res),
        report_materialize(res),
        report_claims(res),
        report_pools(res),
        report_scheduling(res),
        report_consecutive(res),
        report_charts(res),
        report_retention(res),
        report_targets(res),
        report_mariadb(res),
    ]
    lines: list[str] = []
    for section in sections:
        if section:
            lines.extend([*section, ""])
    for e in res.get("errors", []):
        text = e["error"].strip()
        if len(text) > 800:  # the JSON has all of it
            text = f"{text[:300]} [...] {text[-500:]}"
        lines.append(f"ERROR in {e['phase']}: {text}")
    for w in res.get("warnings", []):
        lines.append(f"WARNING: {w}")
    maria = res.get("mariadb") or {}
    for e in maria.get("errors", []):
        lines.append(f"ERROR in the MariaDB pass, {e['phase']}: {e['error'].strip()[-800:]}")
    for w in maria.get("warnings", []):
        lines.append(f"WARNING in the MariaDB pass: {w}")
    if maria:
        lines.append(f"total {res['seconds']:.0f} s, and {maria['seconds']:.0f} s on MariaDB")
    else:
        lines.append(f"total {res['seconds']:.0f} s")
    print("\n".join(lines))


# ------------------------------------------------------------------------------------- main

PHASES = (
    "per_item",
    "spend",
    "throughput",
    "baseline",
    "materialize",
    "claims",
    "pools",
    "scheduling",
    "consecutive",
    "charts",
    "retention",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--items",
        type=int,
        default=None,
        help="items of the batched no-op runs and the bare 100-per-transaction loop (default "
        "20,000; quick 2,000); the per-item runs and the 2-transaction loop take a quarter, "
        "the 20 ms run a fifth, the 1 ms runs an eighth, the 1-transaction loops a tenth",
    )
    p.add_argument("--repeats", type=int, default=None, help="repeats per figure (default 3)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 repeat, small sizes: a smoke test, not a measurement",
    )
    p.add_argument(
        "--json",
        default=str(HERE / "results" / "latest.json"),
        metavar="PATH",
        help="where to write the results (default bench/results/latest.json)",
    )
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
    p.add_argument(
        "--no-mariadb",
        action="store_true",
        help="skip the MariaDB pass (by default it follows the PostgreSQL one when the mysql "
        "driver imports and the server answers)",
    )
    p.add_argument(
        "--mariadb-url",
        default=MARIADB_URL,
        metavar="URL",
        help="MariaDB's bench database (default MARIADB_URL, else "
        "mysql://root@127.0.0.1:3306/fanout_bench)",
    )
    p.add_argument(
        "--database",
        choices=("postgresql", "mariadb"),
        default=None,
        help="run on this server alone: postgresql (DATABASE_URL) or mariadb (--mariadb-url); "
        "by default PostgreSQL, then the MariaDB pass",
    )
    p.add_argument(
        "--chart-items",
        type=int,
        default=None,
        help="finished items of the run whose admin pages the charts phase times "
        "(default 1,000,000; quick 20,000)",
    )
    p.add_argument(
        "--retention-rows",
        type=int,
        default=None,
        help="finished item rows the retention phase prunes beside a live run "
        "(default 1,000,000; quick 20,000)",
    )
    p.add_argument(
        "--retention-batches",
        metavar="N,N",
        default=None,
        help="fanout_prune --batch sizes the retention phase tries, one prune each "
        "(default 2000,500)",
    )
    p.add_argument(
        "--retention-pauses",
        metavar="S,S",
        default=None,
        help="fanout_prune --pause seconds the retention phase tries with each batch size "
        "(default 0,1)",
    )
    p.add_argument("--child-materialize", type=int, help=argparse.SUPPRESS)
    cfg = p.parse_args(argv)
    quick = cfg.quick
    cfg.repeats = cfg.repeats or (1 if quick else 3)
    cfg.items = cfg.items or (2_000 if quick else 20_000)
    # The 1 ms, per-item and 20 ms runs are slower per item: fewer items are enough.
    cfg.sleep_items = max(100, cfg.items // 8)
    cfg.each_items = max(100, cfg.items // 4)
    cfg.slow_items = max(100, cfg.items // 5)
    cfg.bare_items = max(100, cfg.items // 10)
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
    cfg.pool_conc_items = 80 if quick else 480
    cfg.pool_rate_items = 100 if quick else 300
    cfg.consecutive_items = 2_000 if quick else 10_000
    cfg.consecutive_runs = 3 if quick else 5
    cfg.chart_items = cfg.chart_items or (20_000 if quick else 1_000_000)
    cfg.retention_rows = cfg.retention_rows or (20_000 if quick else 1_000_000)
    cfg.retention_batches = sizes(cfg.retention_batches or "2000,500")
    cfg.retention_pauses = [float(x) for x in (cfg.retention_pauses or "0,1").split(",")]
    cfg.retention_chunk = 100  # claims per loop beside the prune: it checks the prune between
    cfg.retention_alone = 200 if quick else 1000
    cfg.phases = [x.strip() for x in cfg.only.split(",") if x.strip()]
    unknown = set(cfg.phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases: {', '.join(sorted(unknown))}")
    return cfg


def mariadb_pass(cfg: argparse.Namespace, res: dict[str, Any]) -> None:
    """Run this script again on MariaDB, the same phases with the same sizes; its results go
    under res["mariadb"]. A separate process, because Django binds its database at setup. An
    unreachable server is a warning: the PostgreSQL figures stand alone."""
    phases = cfg.phases
    why = mariadb_unavailable(cfg.mariadb_url)
    if why:
        res["warnings"].append(f"no MariaDB figures: {why}; --no-mariadb skips the MariaDB pass")
        log(f"warning: {res['warnings'][-1]}")
        return
    fd, name = tempfile.mkstemp(prefix="fanout-bench-mariadb-", suffix=".json")
    os.close(fd)
    out = Path(name)
    sizes = lambda xs: ",".join(str(x) for x in xs)  # noqa: E731
    cmd = [
        sys.executable,
        str(HERE / "run.py"),
        "--database",
        "mariadb",
        "--only",
        ",".join(phases),
        "--json",
        str(out),
        "--items",
        str(cfg.items),
        "--repeats",
        str(cfg.repeats),
        "--materialize",
        sizes(cfg.materialize_sizes),
        "--claim-levels",
        sizes(cfg.claim_levels),
        "--chart-items",
        str(cfg.chart_items),
        "--retention-rows",
        str(cfg.retention_rows),
        "--retention-batches",
        sizes(cfg.retention_batches),
        "--retention-pauses",
        ",".join(f"{x:g}" for x in cfg.retention_pauses),
        *(["--quick"] if cfg.quick else []),
    ]
    # The URL goes by the environment, where a password is not shown to other users.
    env = {**os.environ, "MARIADB_URL": cfg.mariadb_url, "FANOUT_BENCH_LOG_PREFIX": "mariadb: "}
    log(f"MariaDB pass: {', '.join(phases)} (its report follows on stderr)")
    sys.stderr.flush()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=sys.stderr,  # its own report joins the log; ours keeps stdout
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    _children.append(proc)
    try:
        proc.wait()
    except KeyboardInterrupt:  # the PostgreSQL figures are still written
        log("MariaDB pass interrupted")
    finally:
        _stop_process(proc)
        _children.remove(proc)
    try:
        res["mariadb"] = json.loads(out.read_text())
    except (OSError, ValueError):
        res["errors"].append(
            {
                "phase": "mariadb",
                "error": f"the MariaDB pass exited with {proc.returncode} and wrote no results "
                "(its log is above)",
            }
        )
    finally:
        out.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.database == "mariadb":
        # Before the settings read it; workers and subprocesses inherit it.
        os.environ["DATABASE_URL"] = cfg.mariadb_url
    if cfg.child_materialize:
        child_materialize(cfg.child_materialize)
        return 0
    signal.signal(signal.SIGTERM, _on_signal)
    atexit.register(_stop_all_children)

    import django
    from django.conf import settings

    settings.DATABASES  # noqa: B018  (load the settings to read the database)
    if cfg.database == "postgresql" and is_mariadb():
        raise SystemExit("--database postgresql, but DATABASE_URL names a MySQL/MariaDB server")
    ensure_database()
    django.setup()
    migrate()
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
            if k
            not in (
                "json",
                "only",
                "child_materialize",
                "materialize",
                "no_mariadb",
                "mariadb_url",
                "database",
            )
        },
        "database": "mariadb" if is_mariadb() else "postgresql",
        "loadavg": {},
        "errors": [],
        "warnings": [],
    }
    res["config"].update(library_defaults())
    steps = {
        "per_item": lambda: phase_per_item(cfg, logdir),
        "spend": lambda: phase_spend(cfg, logdir),
        "throughput": lambda: phase_throughput(cfg, logdir),
        "baseline": lambda: phase_baseline(cfg),
        "materialize": lambda: phase_materialize(cfg),
        "claims": lambda: phase_claims(cfg),
        "pools": lambda: phase_pools(cfg, logdir),
        "scheduling": lambda: phase_scheduling(cfg, logdir),
        "consecutive": lambda: phase_consecutive(cfg, logdir),
        "charts": lambda: phase_charts(cfg),
        "retention": lambda: phase_retention(cfg, logdir),
    }
    digest = res["machine"]["fanout_code_digest"] = code_digest()
    interrupted = False
    try:
        for phase in PHASES:
            if phase not in cfg.phases:
                continue
            log(f"phase: {phase} (load average {os.getloadavg()[0]:.2f})")
            if code_digest() != digest:
                digest = code_digest()
                res["warnings"].append(
                    f"fanout's code changed before phase {phase}: this process keeps the code it "
                    "loaded, workers and subprocesses started from now on load the new code"
                )
                log(f"  warning: {res['warnings'][-1]}")
            load_before = os.getloadavg()
            try:
                res[phase] = steps[phase]()
                res["loadavg"][phase] = {"before": load_before, "after": os.getloadavg()}
            except (Exception, KeyboardInterrupt) as exc:
                res["errors"].append({"phase": phase, "error": f"{type(exc).__name__}: {exc}"})
                log(f"phase {phase} failed: {type(exc).__name__}: {exc}")
                if isinstance(exc, KeyboardInterrupt):
                    interrupted = True
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
            drop_bare()
        except Exception as exc:  # the report still gets written
            log(f"cleanup failed: {exc}")
    res["seconds"] = time.monotonic() - started
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["carried"] = carried(res)
    res["targets"] = targets(res)
    if not is_mariadb() and cfg.database is None and not cfg.no_mariadb and not interrupted:
        mariadb_pass(cfg, res)
    path = Path(cfg.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print_report(res)
    print(f"\nJSON written to {path}; worker logs in {logdir}")
    return 1 if res["errors"] or res.get("mariadb", {}).get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
