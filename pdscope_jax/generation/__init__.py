"""Whole-model generation (generator), the one sampler (sampling), chat templates and generation defaults (chat)."""
