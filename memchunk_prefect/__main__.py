"""``python -m memchunk_prefect``: the ``memchunk`` command line, where the console script is not on the path."""

import sys

from .cli import main

sys.exit(main())
