"""``python -m chaos.child READY GO -- ARGS``: set Django up, wait at a barrier, run manage.py ARGS.

Children started this way have paid their start-up cost before the harness lets them go, so
competing parents really start the same run at the same instant.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    ready, go = Path(argv[0]), Path(argv[1])
    args = argv[argv.index("--") + 1 :]
    import django

    django.setup()
    from django.core.management import execute_from_command_line

    ready.touch()
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            return 3
        time.sleep(0.001)
    execute_from_command_line(["manage.py", *args])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
