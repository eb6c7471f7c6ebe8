"""``python -m hetd`` is ``hetd``."""

import sys

from hetd.cli import main

sys.exit(main())
