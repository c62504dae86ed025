"""``python -m planner.cli``: the ``planner`` command (used under ``torchrun``)."""

import sys

from planner.cli.main import main

if __name__ == "__main__":  # not when a spawned rank process imports the main module
    sys.exit(main())
