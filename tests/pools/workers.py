"""Workers for the capacity-pool tests: processes started at a barrier and killed as a group,
and inline workers in this process."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from fanout.dispatch import InlineExecutor
from fanout.models import BatchRun
from tests.procs import child_env, release_together, spawn_manage


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child's whole process group (it leads its own session) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


class Workers:
    """``manage.py`` children started at a barrier, so that they begin at the same instant."""

    def __init__(self, database_url: str, tmp_path: Path) -> None:
        self.env = child_env(database_url)
        self.tmp_path = tmp_path
        self.started: list[subprocess.Popen[str]] = []

    def __call__(self, commands: Sequence[Sequence[str]]) -> list[subprocess.Popen[str]]:
        """Start the children and let them go together once all have set Django up."""
        procs, go = self.ready(commands)
        go()
        return procs

    def ready(
        self, commands: Sequence[Sequence[str]]
    ) -> tuple[list[subprocess.Popen[str]], Callable[[], None]]:
        """Start the children; they wait, set up, until the returned function lets them go."""
        first = len(self.started)
        go = self.tmp_path / f"go-{first}"
        ready = [self.tmp_path / f"ready-{first + i}" for i in range(len(commands))]
        procs = [
            spawn_manage(args, self.env, r, go) for args, r in zip(commands, ready, strict=True)
        ]
        self.started.extend(procs)
        return procs, lambda: release_together(procs, ready, go)

    def kill_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                kill_group(proc)


def finished(handle: InlineExecutor) -> BatchRun:
    """Wait (30 s at most) for the inline workers to finish the run; return the run."""
    handle.join(timeout=30)
    assert not handle.alive, "the run's workers did not finish"
    handle.run.refresh_from_db()
    return handle.run
