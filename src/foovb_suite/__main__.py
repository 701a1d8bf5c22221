"""`python -m foovb ...` is the `foovb` command."""

import sys

from .cli import main

sys.exit(main())
