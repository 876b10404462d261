"""``python -m framepipe.run``: torchrun with framepipe supervising each node's ranks.

It takes torchrun's arguments (parsed by torch's own parser) plus ``--hang-timeout``, and
runs torch's elastic agent with a framepipe :class:`~framepipe.workers.WorkerGroup` in place
of torch's process context (see :mod:`framepipe.workers.elastic`). It needs torch; framepipe
itself does not.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the launcher with ``argv`` (default: the command line)."""
    try:
        import torch.distributed.run  # noqa: F401 - the launcher is built on it
    except ImportError as exc:
        sys.exit(
            "python -m framepipe.run needs PyTorch (torch.distributed), which could not be "
            f"imported here: {exc}.\nInstall it (pip install torch; the CPU build is enough) "
            "or launch with torchrun."
        )
    from .workers.elastic import main as elastic_main

    elastic_main(argv)


if __name__ == "__main__":
    main()
