"""The reference trainer is an extra: `pip install rankscope` alone brings only what the exporter needs.

Imported first by the modules that need the extra, so a missing package is one line naming it.
"""

from rankscope._lazy import require

# numpy first: checked before torch is imported, which warns at import when numpy is missing.
require("trainer", "numpy", "torchvision", "transformers", "PIL")
