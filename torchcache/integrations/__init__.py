"""Integrations with training frameworks people already use (DESIGN.md §9.4); each module imports
its framework lazily, as an optional extra: ``torchcache.integrations.transformers``."""
