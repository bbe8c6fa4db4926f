"""``python -m sgl_pic.check``: the per-model gate's stable name (``sgl_pic.cli.check``)."""

import sys

from sgl_pic.cli.check import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
