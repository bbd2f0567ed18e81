"""`python -m rankscope.report` is `rankscope-report`."""

import sys

from rankscope.report.cli import main

sys.exit(main())
