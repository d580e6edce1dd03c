"""``python -m tierckpt``: the command line (see :mod:`tierckpt.cli.main`)."""

import sys

from tierckpt.cli.main import main

sys.exit(main())
