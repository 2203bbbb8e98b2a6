"""`python -m handoff_broker ...` is the `handoff-broker` command."""

import sys

from .cli import main

sys.exit(main())
