"""The PyTorch Lightning callback (needs the `lightning` extra). The user guide is docs/integrations.md."""

from rankscope.integrations.lightning.callback import RankscopeCallback, config_hash
from rankscope.integrations.lightning.resume import newest_checkpoint

__all__ = ["RankscopeCallback", "config_hash", "newest_checkpoint"]
