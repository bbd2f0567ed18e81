"""The reference trainer is an extra: `pip install rankscope` alone brings only what the exporter needs.

Imported first by the modules that need the extra, so a missing package is one line naming it.
"""

from rankscope._lazy import require

require("trainer", "torchvision", "transformers", "PIL")
