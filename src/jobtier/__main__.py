"""``python -m jobtier``: the ``jobtier`` command without its console script."""

import sys

from jobtier.cli import entry

sys.exit(entry())
