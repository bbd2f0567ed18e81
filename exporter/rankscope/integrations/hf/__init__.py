"""The Hugging Face Trainer callback (needs the `hf` extra). The user guide is docs/integrations.md."""

from rankscope.integrations.hf.callback import RankscopeCallback, config_hash

__all__ = ["RankscopeCallback", "config_hash"]
