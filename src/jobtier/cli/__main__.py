"""``python -m jobtier.cli``: the ``jobtier`` command without its console script."""

import sys

from jobtier.cli.main import main

sys.exit(main())
