"""``python -m protos.client``: see :mod:`protos.client.cli`."""

from __future__ import annotations

import sys

from protos.client.cli import main

if __name__ == "__main__":
    sys.exit(main())
