"""Quantized routed experts: formats (`formats`), the loader wrapper that quantizes as weights arrive (`loader`)
and the on-disk cache of a checkpoint's quantized experts (`cache`)."""
