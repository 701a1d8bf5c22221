"""`python -m foovb_suite ...` is the `foovb` command."""

import sys

from .command import main

sys.exit(main())
