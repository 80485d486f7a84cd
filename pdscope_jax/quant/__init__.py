"""Quantized routed experts: formats (`formats`) and the loader wrapper that quantizes as weights arrive."""
