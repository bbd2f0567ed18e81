"""`python -m exporter.report` is `rankscope-report`."""

import sys

from .cli import main

sys.exit(main())
