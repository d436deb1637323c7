"""The harness: its database and Redis, its workers, the figures and verdict of a scenario."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .ledger import Figures, analyse, describe_reclaims
from .procs import ROOT, Death, Proc, RedisServer, WorkerPool, spawn

DEFAULT_DATABASE_URL = "postgres://root@127.0.0.1:5432/fanout_chaos"
# A worker's death must be followed by its item's reclaim within its lease plus this.
RECLAIM_SLACK = 5.0
# Items of the largest run (the worker crashes); the other long runs are sized from it.
FULL_ITEMS, QUICK_ITEMS = 2000, 400
# The join's lease in the harness's children (FANOUT_JOIN_LEASE_SECONDS, default 60 s): a join
# cut off by a kill (trees of runs join all the time) is taken over this long after, not a
# minute later. It still outlives a PostgreSQL outage, so a live joiner keeps its join.
JOIN_LEASE = 10.0
FINISHED = ("succeeded", "failed", "cancelled", "compensated", "compensation_failed")


@dataclass
class Options:
    items: int | None = None
    quick: bool = False
    only: list[str] = field(default_factory=list)
    json: Path | None = None
    database_url: str = DEFAULT_DATABASE_URL
    pg_fault: str = "restart"  # "restart" the server, or "terminate" this database's sessions
    workers: int = 8
    drop_database: bool = False
    keep_logs: bool = False


@dataclass
class Result:
    """One scenario's figures and checks; it passes when every check does."""

    name: str
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, failure: str) -> bool:
        if not ok:
            self.failures.append(failure)
        return ok

    @property
    def passed(self) -> bool:
        return not self.failures

    def line(self) -> str:
        figures = "  ".join(f"{k} {v}" for k, v in self.figures.items())
        verdict = "PASS" if self.passed else "FAIL: " + "; ".join(self.failures)
        return f"{self.name:<14} {figures}  [{self.seconds:.0f}s] {verdict}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "failures": self.failures,
            "figures": self.figures,
            "seconds": round(self.seconds, 1),
            "details": self.details,
        }


def durable[T](op: Callable[[], T], seconds: float = 120.0) -> T:
    """Run a database operation of the harness itself; wait out a restarting server."""
    from django.db import InterfaceError, OperationalError, connection

    deadline = time.monotonic() + seconds
    while True:
        try:
            return op()
        except (OperationalError, InterfaceError):
            connection.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


class Harness:
    """Everything a scenario needs: scaled item counts, children, waiting and the ledger."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.logs = Path(tempfile.mkdtemp(prefix="fanout-chaos-"))
        self.nonce = secrets.token_hex(3)
        self.redis = RedisServer(self.logs)
        self.env: dict[str, str] = {}
        self.workers: WorkerPool | None = None
        self.deaths: dict[int, Death] = {}  # parents the harness killed
        self.redis_reset_at = 0.0
        self._children: list[Proc] = []
        self._seq = 0
        self._mark = (0, 0)
        self._last_run = 0  # runs after this id are the scenario's
        self._pool_drift: dict[str, int] = {}  # corrections each pool had before the scenario

    # ------------------------------------------------------------------ set up, tear down

    def setup(self) -> None:
        url = self.opts.database_url
        _ensure_database(url)
        self.redis.start()
        os.environ.update(
            DATABASE_URL=url,
            REDIS_URL=self.redis.url,
            # The test settings, with the FANOUT_* budgets below read from the environment.
            DJANGO_SETTINGS_MODULE="tests.rq.worker_settings",
            FANOUT_JOIN_LEASE_SECONDS=f"{JOIN_LEASE:g}",
            DEBUG="0",
        )
        self.env = dict(os.environ)
        self.env.update(PYTHONUNBUFFERED="1", FANOUT_LOG_LEVEL="INFO")
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0, interactive=False)
        self._clean()
        self.workers = WorkerPool(self.env, self.logs, self.opts.workers, f"chaos-{self.nonce}")
        self.workers.start()
        self.workers.wait_ready(self.redis)

    def _clean(self) -> None:
        """Forget earlier harness runs in this database (one harness per database at a time)."""
        from fanout.models import BatchRun
        from tests.testapp.models import Execution, Observation

        old = list(BatchRun.objects.filter(definition__startswith="chaos_").values_list("pk"))
        ids = [pk for (pk,) in old]
        Execution.objects.filter(run_id__in=ids).delete()
        Observation.objects.filter(run_id__in=ids).delete()
        BatchRun.objects.filter(pk__in=ids).delete()

    def teardown(self) -> None:
        for proc in self._children:
            if proc.popen.poll() is None:
                proc.kill()
        if self.workers is not None:
            self.workers.stop()
        self.redis.stop()
        from django.db import connections

        connections.close_all()
        if self.opts.drop_database:
            _drop_database(self.opts.database_url)

    def begin(self) -> None:
        """Mark where this scenario's logs, runs and audit corrections start."""
        from fanout.models import BatchRun, CapacityPool

        log = self.logs / "workers.log"
        self._mark = (log.stat().st_size if log.exists() else 0, len(self._children))
        last = durable(lambda: BatchRun.objects.order_by("-pk").values_list("pk", flat=True)[:1])
        self._last_run = last[0] if last else 0
        self._pool_drift = durable(
            lambda: dict(CapacityPool.objects.values_list("name", "counter_drift"))
        )

    def end(self) -> None:
        """Stop what a scenario left behind: its parents, and its runs if still open."""
        from fanout.actions import cancel_run
        from fanout.models import BatchRun

        for proc in self._children[self._mark[1] :]:
            if proc.popen.poll() is None:
                proc.kill()
        open_runs = durable(
            lambda: list(
                BatchRun.objects.filter(
                    definition__startswith="chaos_", status__in=("pending", "running", "joining")
                )
            )
        )
        for run in open_runs:
            durable(lambda r=run: cancel_run(r, "cancelled by the chaos harness"))

    def counter_drift(self, result: Result) -> None:
        """Every counter of the scenario's runs and of every pool equals its rows, and the
        workers' audit corrected none of them meanwhile (a correction hides a drift that was).

        Read under each counter's lock, as the audit reads it: a count taken beside moving
        items proves nothing.
        """
        from django.db import transaction

        from fanout.audit import measure_pool, measure_run
        from fanout.models import BatchRun, CapacityPool

        def read() -> tuple[list[str], list[str]]:
            found, corrected = [], []
            runs = BatchRun.objects.filter(pk__gt=self._last_run).order_by("pk")
            for pk, drift in runs.values_list("pk", "counter_drift"):
                with transaction.atomic():
                    counter, rows = measure_run(pk) or (0, 0)
                if counter != rows:
                    found.append(f"run {pk} in_flight {counter}, its rows {rows}")
                if drift:
                    corrected.append(f"run {pk} {drift}x")
            for name, drift in CapacityPool.objects.values_list("name", "counter_drift"):
                with transaction.atomic():
                    counter, rows = measure_pool(name) or (0, 0)
                if counter != rows:
                    found.append(f"pool {name} in_flight {counter}, its rows {rows}")
                if drift > self._pool_drift.get(name, 0):
                    corrected.append(f"pool {name} {drift - self._pool_drift.get(name, 0)}x")
            return found, corrected

        found, corrected = durable(read)
        result.figures["drift"] = len(found) + len(corrected)
        result.check(not found, "counter drift: " + "; ".join(found[:4]))
        audited = "; ".join(corrected[:4])
        result.check(not corrected, f"counter drift corrected by the workers' audit: {audited}")

    def deadlocks(self) -> int:
        """Deadlocks PostgreSQL broke between fanout's transactions since ``begin``."""
        with open(self.logs / "workers.log", "rb") as f:
            f.seek(self._mark[0])
            texts = [f.read().decode(errors="replace")]
        texts += [p.err.read_text(errors="replace") for p in self._children[self._mark[1] :]]
        return sum(t.count("deadlock detected") for t in texts)

    # ------------------------------------------------------------------------- helpers

    def scale(self, full: int, quick: int) -> int:
        return quick if self.opts.quick else full

    def items(self, share: float, least: int = 50) -> int:
        """A long run's items: ``share`` of --items (2000 by default, 400 with --quick)."""
        total = self.opts.items or (QUICK_ITEMS if self.opts.quick else FULL_ITEMS)
        return max(least, round(total * share))

    def run_key(self, name: str) -> str:
        return f"chaos-{self.nonce}-{name}"

    def parent(
        self,
        args: Sequence[str],
        name: str,
        barrier: tuple[Path, Path] | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Start ``manage.py ARGS``; its output is kept in the log directory."""
        self._seq += 1
        proc = spawn(args, f"{self._seq:02d}-{name}", env or self.env, self.logs, barrier)
        self._children.append(proc)
        return proc

    def manage(self, args: Sequence[str], name: str, timeout: float = 120) -> tuple:
        return self.parent(args, name).finish(timeout)

    def wait_files(self, paths: Sequence[Path], procs: Sequence[Proc], timeout: float = 90) -> None:
        """Wait until children reach their barrier (each touches its ready file)."""
        deadline = time.monotonic() + timeout
        while not all(p.exists() for p in paths):
            for proc in procs:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited before its barrier (see {proc.err})")
            if time.monotonic() > deadline:
                raise RuntimeError("children did not reach their barrier")
            time.sleep(0.05)

    def kill_parent(self, proc: Proc) -> Death:
        death = Death(proc.pid, proc.kill(), "killed")
        self.deaths[proc.pid] = death
        return death

    def all_deaths(self) -> dict[int, Death]:
        deaths = dict(self.workers.deaths) if self.workers else {}
        deaths.update(self.deaths)
        return deaths

    def run_id(self, run_key: str, timeout: float = 60) -> int:
        """The id of the run with ``run_key`` once a parent has written all its items."""
        from fanout.models import BatchRun

        deadline = time.monotonic() + timeout
        while True:
            found = durable(
                lambda: (
                    BatchRun.objects.filter(run_key=run_key)
                    .exclude(status="pending")
                    .values_list("pk", flat=True)
                    .first()
                )
            )
            if found:
                return int(found)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no run {run_key} after {timeout}s")
            time.sleep(0.1)

    def progress(self, run_id: int) -> float:
        """The share of the run's items that are finished."""
        from fanout.models import BatchRun, ItemClaim

        def read() -> float:
            total = BatchRun.objects.filter(pk=run_id).values_list("total_items", flat=True)[0]
            done = ItemClaim.objects.filter(run_id=run_id).terminal().count()
            return done / total if total else 1.0

        return durable(read)

    def wait_progress(self, run_id: int, share: float, timeout: float = 120) -> bool:
        deadline = time.monotonic() + timeout
        while self.progress(run_id) < share:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def wait_finished(self, run_ids: Sequence[int], timeout: float) -> bool:
        """Wait until every run is finished (succeeded, failed, cancelled or compensated)."""
        from fanout.models import BatchRun

        deadline = time.monotonic() + timeout
        while True:
            open_runs = durable(
                lambda: BatchRun.objects.filter(pk__in=run_ids).exclude(status__in=FINISHED).count()
            )
            if not open_runs:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def wait_handlers(self, run_ids: Sequence[int], timeout: float = 30) -> None:
        """Let handlers that outlived their lease (a hang) finish writing the ledger."""
        from tests.testapp.models import Execution

        deadline = time.monotonic() + timeout
        deaths = self.all_deaths()
        while time.monotonic() < deadline:
            open_pids = durable(
                lambda: set(
                    Execution.objects.filter(run_id__in=run_ids, ended__isnull=True).values_list(
                        "worker", flat=True
                    )
                )
            )
            alive = [w for w in open_pids if int(w.rsplit(":", 1)[-1]) not in deaths]
            if not alive:
                return
            time.sleep(0.2)
            deaths = self.all_deaths()

    def busy_workers(self, run_id: int) -> list[int]:
        """Pids of the processes that hold a live claim on an item of the run."""
        from fanout.models import ItemClaim

        owners = durable(
            lambda: list(
                ItemClaim.objects.filter(run_id=run_id, status="running").values_list(
                    "owner", flat=True
                )
            )
        )
        pids = []
        for owner in owners:
            try:
                pids.append(int(owner.split(":")[1]))
            except (IndexError, ValueError):
                continue
        return pids

    def ledger(self, run_ids: list[int], pools: dict[str, dict[str, Any]] | None = None) -> Figures:
        return durable(lambda: analyse(run_ids, self.all_deaths(), pools))

    # ------------------------------------------------------------------- the verdict

    def judge(
        self,
        result: Result,
        fig: Figures,
        lease: float | None = None,
        pools: dict[str, dict[str, Any]] | None = None,
        joins_cut: dict[int, int] | None = None,
    ) -> None:
        """The figures every scenario reports, and the checks every scenario must pass.

        ``lease``: workers die in this scenario, and their items must be reclaimed within it
        (plus a slack). ``pools``: {name: {"concurrency", "rate", "burst", "period"}} to check.
        ``joins_cut``: {run id: joins of that run a kill cut off}; each ran once more.
        """
        dup = len(fig.duplicates)
        result.figures.update(
            {
                "items": fig.items,
                "once": fig.once,
                "dup": f"{dup}({fig.duplicate_keys()})" if dup else 0,
                "lost": fig.lost,
                "inflight": f"{fig.inflight_run}/{fig.limit_run}",
            }
        )
        result.check(fig.lost == 0, f"{fig.lost} items lost (not finished)")
        for text in fig.violations[:3]:
            result.check(False, text)
        if len(fig.violations) > 3:
            result.check(False, f"... {len(fig.violations) - 3} more violations")
        result.check(
            fig.inflight_run <= fig.limit_run,
            f"{fig.inflight_run} in flight over max_parallel {fig.limit_run}",
        )
        adm = []
        for name, limits in (pools or {}).items():
            in_pool, admitted = fig.inflight_pool.get(name, 0), fig.admissions.get(name, 0)
            # A token bucket admits at most burst + rate x T / period in any T seconds.
            bound = limits["burst"] + limits["rate"]
            adm.append(f"{admitted}/{limits['period']:g}s (rate {limits['rate']}, bound {bound})")
            result.figures["pool inflight"] = f"{in_pool}/{limits['concurrency']}"
            result.check(
                in_pool <= limits["concurrency"],
                f"{in_pool} in flight in pool {name} of {limits['concurrency']}",
            )
            result.check(admitted <= bound, f"{admitted} admissions in one period (bound {bound})")
        result.figures["adm"] = ", ".join(adm) or "-"
        result.figures["reclaim"] = describe_reclaims(fig.reclaims)
        if lease is not None:
            slowest = max(fig.reclaims, default=0.0)
            result.check(
                slowest <= lease + RECLAIM_SLACK,
                f"an item was reclaimed {slowest:.1f}s after its worker died (lease {lease:g}s)",
            )
        elif fig.reclaims:
            result.check(False, "items were reclaimed in a scenario where no worker should die")
        if fig.join_runs:
            cut, runs = joins_cut or {}, fig.join_runs
            texts = [f"{n}({cut[r]} cut)" if cut.get(r) else str(n) for r, n in runs.items()]
            if len(texts) > 3:  # a tree of runs: how many runs joined how often
                texts = [f"{t}x{k}" for t, k in Counter(texts).items()]
            result.figures["join"] = ",".join(texts)
            for run_id, count in fig.join_runs.items():
                result.check(
                    count - cut.get(run_id, 0) == 1,
                    f"the join of run {run_id} ran {count} times"
                    + (f" ({cut[run_id]} cut off by kills)" if cut.get(run_id) else ""),
                )
        result.details["ledger"] = fig.as_dict()

    def report_parent(self, result: Result, name: str, outcome: tuple, want: str) -> Any:
        """Check a parent's exit and JSON report; return the report."""
        code, out, err = outcome
        report = _last_json(out)
        status = report.get("status") if report else None
        result.details.setdefault("parents", {})[name] = {
            "exit": code,
            "status": status,
            "stderr": err[-1500:],
        }
        expected = 0 if want == "succeeded" else 1
        if "Traceback" in err:
            last = [line for line in err.strip().splitlines() if line.strip()][-1]
            result.check(False, f"{name} crashed: {last[:160]}")
        elif code != expected or status != want:
            result.check(False, f"{name} exited {code} with run {status} (expected {want})")
        return report


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _admin_url(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    return urlunsplit(parts._replace(path="/postgres")), name


def _ensure_database(url: str) -> None:
    import psycopg

    admin, name = _admin_url(url)
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def _drop_database(url: str) -> None:
    import psycopg

    admin, name = _admin_url(url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def postgres_outage(url: str, mode: str, seconds: float = 3.0) -> dict[str, Any]:
    """Restart the PostgreSQL server, or (``terminate``) cut and refuse this database's sessions.

    ``terminate`` disturbs nobody else on the server: it kills every session of the database and
    refuses new ones for ``seconds``, which workers see exactly as they see a restart.
    """
    import psycopg

    admin, name = _admin_url(url)
    started = time.time()
    if mode == "restart" and Path("/etc/postgresql").is_dir():
        version = sorted(os.listdir("/etc/postgresql"), key=lambda v: float(v))[-1]
        done = subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctlcluster restart failed: {done.stderr.strip()}")
        how = f"PostgreSQL {version} restarted"
    else:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                [name],
            )
            time.sleep(seconds)
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        how = f"sessions of {name} terminated, connections refused for {seconds:g}s"
    # Wait until the database answers again.
    deadline = time.monotonic() + 60
    while True:
        try:
            with psycopg.connect(url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            break
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    return {"how": how, "down_seconds": round(time.time() - started, 1)}


__all__ = ["ROOT", "Harness", "Options", "Result", "durable", "postgres_outage"]
