"""`python -m cli ...` is `specdec ...`."""

import sys

from cli.main import main

sys.exit(main())
