"""`python -m graphdist` is the `graphdist` command."""

import sys

from graphdist.cli import main

sys.exit(main())
