"""Whole-model generation: prefill and decode loops, sampling, timings."""
