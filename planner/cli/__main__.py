"""``python -m planner.cli``: the ``planner`` command (used under ``torchrun``)."""

import sys

from planner.cli.main import main

sys.exit(main())
