"""Text in and out: tokenizers and the corpora found on the machine."""
