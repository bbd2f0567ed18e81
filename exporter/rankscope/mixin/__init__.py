"""The rule pack, shaped like a monitoring mixin: one config, recording and alert rules by area,
dashboards and Alertmanager routes, all generated from it (``rankscope-mixin``)."""
