"""``python -m framepipe.bench ...`` is ``python -m framepipe bench ...``."""

import sys

from .cli import run_argv

sys.exit(run_argv(sys.argv[1:]))
