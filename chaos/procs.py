"""The processes the harness runs: a Redis server of its own, RQ workers, run_fanout parents.

Every child is started in its own session, so a SIGKILL of its process group kills it and
anything it forked. Only children started here are ever signalled.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_group(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    """Signal the child's whole process group (it leads its own session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class RedisServer:
    """A redis-server of the harness's own, so stopping or flushing it disturbs nobody else."""

    def __init__(self, logs: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = open(self.logs / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)

    def ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except Exception:
            return False

    def stop(self) -> None:
        """Kill the server: everything it held is lost (it never saves)."""
        if self.proc is not None:
            kill_group(self.proc)
            self.proc.wait()
            self.proc = None

    def flush(self) -> None:
        self.client().flushall()


@dataclass
class Death:
    pid: int
    at: float
    how: str  # "killed" by the harness, or "exited" on its own (with its exit code)


@dataclass
class Proc:
    """A child process whose output goes to log files."""

    name: str
    popen: subprocess.Popen[bytes]
    out: Path
    err: Path
    started: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def finish(self, timeout: float) -> tuple[int | None, str, str]:
        """Wait for the child (kill it past ``timeout``); return (exit code, stdout, stderr)."""
        try:
            code: int | None = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.popen)
            self.popen.wait()
            code = None
        return code, self.out.read_text(errors="replace"), self.err.read_text(errors="replace")

    def kill(self) -> float:
        at = time.time()
        kill_group(self.popen)
        self.popen.wait()
        return at


def spawn(
    args: Sequence[str],
    name: str,
    env: dict[str, str],
    logs: Path,
    barrier: tuple[Path, Path] | None = None,
) -> Proc:
    """Start ``manage.py ARGS`` (behind a barrier of ready/go files if given)."""
    if barrier is None:
        command = [PYTHON, "manage.py", *args]
    else:
        # The test suite's barrier child: set Django up, touch READY, wait for GO, run manage.py.
        command = [
            PYTHON,
            "-m",
            "tests.procs",
            "manage",
            "--ready",
            str(barrier[0]),
            "--go",
            str(barrier[1]),
            "--",
            *args,
        ]
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        popen = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=o, stderr=e, start_new_session=True
        )
    return Proc(name, popen, out, err)


class WorkerPool:
    """``manage.py rqworker fanout`` processes, restarted when they die (as a supervisor would)."""

    def __init__(self, env: dict[str, str], logs: Path, size: int, prefix: str) -> None:
        self.env = env
        self.logs = logs
        self.size = size
        self.prefix = prefix
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.names: dict[int, str] = {}
        self.spawned: dict[int, float] = {}
        self.deaths: dict[int, Death] = {}
        self.respawn = True
        self._seq = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="chaos-workers", daemon=True)
        self._log: IO[bytes] = open(logs / "workers.log", "ab")

    def start(self) -> WorkerPool:
        with self._lock:
            for _ in range(self.size):
                self._spawn()
        self._thread.start()
        return self

    def _spawn(self) -> None:
        self._seq += 1
        name = f"{self.prefix}-{self._seq}"
        popen = subprocess.Popen(
            [PYTHON, "manage.py", "rqworker", "fanout", "--name", name],
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[popen.pid] = popen
        self.names[popen.pid] = name
        self.spawned[popen.pid] = time.time()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                for pid, popen in list(self.procs.items()):
                    code = popen.poll()
                    if code is None:
                        continue
                    del self.procs[pid]
                    self.deaths.setdefault(pid, Death(pid, time.time(), f"exited {code}"))
                    if self.respawn:
                        self._spawn()

    def pids(self) -> list[int]:
        with self._lock:
            return list(self.procs)

    def kill(self, pid: int) -> Death | None:
        """SIGKILL one worker's process group and start a replacement."""
        with self._lock:
            popen = self.procs.pop(pid, None)
            if popen is None:
                return None
            death = Death(pid, time.time(), "killed")
            kill_group(popen)
            popen.wait()
            self.deaths[pid] = death
            if self.respawn:
                self._spawn()
            return death

    def kill_one(self, prefer: Sequence[int] = ()) -> Death | None:
        """Kill a random worker, among ``prefer`` (say, the busy ones) when any is ours."""
        with self._lock:
            mine = [p for p in prefer if p in self.procs] or list(self.procs)
            return self.kill(random.choice(mine)) if mine else None

    def redeploy(self) -> int:
        """SIGKILL every worker at once, then start as many new ones; return how many died."""
        with self._lock:
            self.respawn = False
            pids = list(self.procs)
            for pid in pids:
                self.kill(pid)
            self.respawn = True
            for _ in range(self.size):
                self._spawn()
        return len(pids)

    def wait_ready(self, redis: RedisServer, since: float = 0.0, timeout: float = 90) -> None:
        """Wait until every worker started after ``since`` has registered with Redis.

        Workers started before ``since`` (when Redis lost everything) were ready by then.
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                names = [self.names[p] for p in self.procs if self.spawned[p] >= since]
            try:
                client = redis.client()
                if len(self.procs) >= self.size and all(
                    client.exists(f"rq:worker:{n}") for n in names
                ):
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"RQ workers did not start within {timeout}s (see workers.log)")
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            self.respawn = False
            for popen in self.procs.values():
                kill_group(popen)
            for popen in self.procs.values():
                popen.wait()
            self.procs.clear()
        self._log.close()
