"""The distribution ships the reusable app and its licence, and nothing of the example project
or the tests."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, and the wheel built from it (so a file the sdist forgets fails the wheel)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "-q", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out


def test_the_wheel_holds_fanout_with_its_migrations_templates_and_static_files_only(
    dist: Path,
) -> None:
    (wheel,) = dist.glob("django_batch_fanout-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = [n for n in names if ".dist-info/" not in n]

    assert shipped and all(n.startswith("fanout/") for n in shipped), shipped
    assert "fanout/migrations/0001_initial.py" in shipped
    assert "fanout/py.typed" in shipped
    assert "fanout/management/commands/run_fanout.py" in shipped
    assert any(n.startswith("fanout/templates/fanout/") for n in shipped)
    assert any(n.startswith("fanout/static/fanout/") for n in shipped)


def test_the_wheel_declares_the_bsd_licence_and_carries_its_text(dist: Path) -> None:
    (wheel,) = dist.glob("django_batch_fanout-*.whl")
    archive = zipfile.ZipFile(wheel)
    (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    headers = HeaderParser().parsestr(archive.read(metadata).decode())
    licences = [n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")]

    assert headers["License-Expression"] == "BSD-3-Clause"
    assert headers.get_all("License-File") == ["LICENSE"]
    assert len(licences) == 1
    assert archive.read(licences[0]).decode() == (ROOT / "LICENSE").read_text()


def test_the_sdist_carries_the_licence(dist: Path) -> None:
    (sdist,) = dist.glob("django_batch_fanout-*.tar.gz")
    names = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}

    assert "LICENSE" in names
    assert "fanout/migrations/0001_initial.py" in names


def make_dry_run(target: str, venv: Path) -> str:
    """What `make TARGET` would run on a machine without the virtualenv yet (make -n)."""
    done = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout


def test_make_demo_installs_only_the_package_and_its_example_extra_and_never_apt_get(
    tmp_path: Path,
) -> None:
    demo = make_dry_run("demo", tmp_path / "venv")

    installs = [line for line in demo.splitlines() if "pip install" in line and " -e " in line]
    assert installs == [f'{tmp_path / "venv"}/bin/python -m pip install -qq -e ".[example]"']
    assert "apt" not in demo and "mysql-build-deps" not in demo and "test-deps" not in demo


def test_make_test_installs_the_development_environment(tmp_path: Path) -> None:
    test = make_dry_run("test", tmp_path / "venv")

    assert "scripts/mysql-build-deps.sh" in test
    assert "extras=dev,mysql" in test
