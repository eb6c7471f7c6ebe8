"""``python -m hetd`` is ``hetd`` (malloc settings included, see :mod:`hetd.launch`)."""

import sys

from hetd.launch import hetd_main

sys.exit(hetd_main())
