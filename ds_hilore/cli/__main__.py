"""``python -m ds_hilore.cli``: the ``hilore`` command."""

import sys

from ds_hilore.cli import main

sys.exit(main())
