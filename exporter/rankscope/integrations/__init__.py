"""Integrations with training frameworks: one subpackage per framework (hf, lightning)."""
