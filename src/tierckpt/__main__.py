"""``python -m tierckpt``: the command line (see :mod:`tierckpt.cli`)."""

import sys

from .cli import main

sys.exit(main())
