"""Text <-> token ids through a checkpoint's `tokenizer.json`, and normalisation of token-id inputs.

Contract: `Tokenizer.from_dir(path)` returns a `Tokenizer` when the directory holds `tokenizer.json`, else None.
`token_batch(inputs, tokenizer)` turns a string, a list of strings, a list of ids, a list of id lists or an
array into int32 [B, T]; sequences of different lengths raise ValueError (no padding is done), and strings
without a tokenizer raise ValueError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import tokenizers

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._tok = tokenizers.Tokenizer.from_file(str(self.path))

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer | None":
        path = Path(directory) / TOKENIZER_FILE
        return cls(path) if path.exists() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def token_batch(inputs, tokenizer: Tokenizer | None) -> np.ndarray:
    """int32 [B, T] from text or ids; see the module docstring."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, str) for x in inputs):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer.json beside the checkpoint; pass token ids instead")
        inputs = [tokenizer.encode(text) for text in inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(np.isscalar(x) for x in inputs):
        inputs = [inputs]
    if isinstance(inputs, (list, tuple)):
        lengths = sorted({len(row) for row in inputs})
        if len(lengths) > 1:
            raise ValueError(f"sequences of different lengths {lengths} in one batch: batches must be rectangular "
                             "(equal-length prompts); run them separately")
    ids = np.asarray(inputs)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"expected integer token ids of shape [batch, tokens], got {ids.dtype} {ids.shape}")
    return ids.astype(np.int32)
