"""``python -m oases ...``: the same as the ``oases`` command."""

import sys

from oases.cli import main

if __name__ == "__main__":
    sys.exit(main())
