#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    try:
        from django.core.management import execute_from_command_line
    except ImportError as exc:
        raise ImportError(
            "Couldn't import Django. Run `make venv` and use .venv/bin/python, "
            "or activate a virtualenv where the project is installed."
        ) from exc
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
