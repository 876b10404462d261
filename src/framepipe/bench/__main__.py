"""``python -m framepipe.bench ...`` is ``python -m framepipe bench ...``."""

import sys

from . import main

sys.exit(main(sys.argv[1:]))
