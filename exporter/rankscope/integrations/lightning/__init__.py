"""The PyTorch Lightning callback (needs the `lightning` extra). The user guide is docs/integrations.md."""

from rankscope.integrations.lightning.callback import RankscopeCallback, config_hash

__all__ = ["RankscopeCallback", "config_hash"]
