"""``python -m ckptkit ...`` is ``ckptkit ...``."""

import sys

from .cli import main

sys.exit(main())
