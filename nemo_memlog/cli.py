"""``python -m nemo_memlog.cli``: the ``nemo-memlog`` command (nemo_memlog.offline.cli)."""

import sys

from .offline.cli import main

if __name__ == "__main__":
    sys.exit(main())
