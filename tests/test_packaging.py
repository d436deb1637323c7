"""The distribution ships the reusable app and nothing of the example project or the tests."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_fanout_with_its_migrations_templates_and_static_files_only(
    tmp_path: Path,
) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("django_fanout-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = [n for n in names if ".dist-info/" not in n]

    assert shipped and all(n.startswith("fanout/") for n in shipped), shipped
    assert "fanout/migrations/0001_initial.py" in shipped
    assert "fanout/py.typed" in shipped
    assert "fanout/management/commands/run_fanout.py" in shipped
    assert any(n.startswith("fanout/templates/fanout/") for n in shipped)
    assert any(n.startswith("fanout/static/fanout/") for n in shipped)
