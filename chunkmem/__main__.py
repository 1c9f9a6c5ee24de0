"""``python -m chunkmem``: the ``chunkmem`` command (chunkmem/cli)."""

import sys

from chunkmem.cli import main

sys.exit(main())
