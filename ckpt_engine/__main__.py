"""``python -m ckpt_engine``: the command line (same as the ``ckpt`` console script)."""

import sys

from .cli import main

sys.exit(main())
