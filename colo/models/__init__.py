"""Tiny model and tokenizer generators for tests, demos and dry runs (see colo.models.tiny)."""
