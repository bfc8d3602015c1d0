"""``python -m memchunk_prefect``: the ``memchunk`` command line, where the console script is not on the path."""

import sys

from memchunk_prefect.cli.app import main

sys.exit(main())
