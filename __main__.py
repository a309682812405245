"""`python -m edgecore`: the same command as the `edgecore` entry point."""

import sys

from edgecore.deploy.cli import main

sys.exit(main())
