"""Text <-> token ids through a checkpoint's `tokenizer.json`, and normalisation of token-id inputs.

Contract: `Tokenizer.from_dir(path)` returns a `Tokenizer` when the directory holds `tokenizer.json`, else None.
`token_batch(inputs, tokenizer)` turns a string, a list of strings, a list of ids, a list of id lists or an
array into int32 [B, T] with B >= 1 and T >= 1. Ids are checked on the values given, before the cast: integers
within [0, vocab_size) (within [0, 2**31) without a vocab_size), so no id changes in the cast. Every problem
(ragged rows, strings without a tokenizer, wrong dtype or shape, ids out of range) raises `errors.InputError`
(a ValueError); no padding is done.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Sequence

import numpy as np
import tokenizers

from pdscope_jax.errors import InputError

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


def token_batch(inputs, tokenizer: Tokenizer | None, vocab_size: int | None = None) -> np.ndarray:
    """int32 [B, T] from text or ids; see the module docstring."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, str) for x in inputs):
        if tokenizer is None:
            raise InputError("a text prompt needs a tokenizer.json beside the checkpoint; pass token ids instead")
        inputs = [tokenizer.encode(text) for text in inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(np.isscalar(x) for x in inputs):
        inputs = [inputs]
    if isinstance(inputs, (list, tuple)):
        try:
            lengths = sorted({len(row) for row in inputs})
        except TypeError:
            raise InputError("token ids: expected a list of id lists (or a [batch, tokens] array), got a list "
                             "mixing single ids and sequences") from None
        if len(lengths) > 1:
            raise InputError(f"sequences of different lengths {lengths} in one batch: batches must be rectangular "
                             "(equal-length prompts); run them separately")
    try:
        ids = np.asarray(inputs)
    except (ValueError, TypeError) as e:
        raise InputError(f"token ids: cannot read them as a [batch, tokens] array of integers ({e})") from None
    if ids.ndim == 1:
        ids = ids[None]
    problems = []
    if ids.ndim != 2 or 0 in ids.shape:
        problems.append(f"expected integer token ids of shape [batch, tokens] with at least one sequence of at "
                        f"least one token, got {ids.dtype} {ids.shape}")
    integral = np.issubdtype(ids.dtype, np.integer) or (ids.dtype == object and all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in ids.flat))
    if ids.size and not integral:
        problems.append(f"expected integer token ids, got {ids.dtype} (e.g. {ids.flat[0]!r}); pass ints")
    if ids.size and integral:
        # on the values given, before any cast; numpy's min/max are exact for integer dtypes, and only an object
        # array (Python ints, possibly beyond 64 bits) needs Python's
        if ids.dtype == object:
            lo, hi = int(min(ids.flat)), int(max(ids.flat))
        else:
            lo, hi = int(ids.min()), int(ids.max())
        limit = 2**31 if vocab_size is None else vocab_size
        if lo < 0 or hi >= limit:
            problems.append(f"token ids must lie in [0, {limit}); got {lo}..{hi}")
    if problems:
        raise InputError("; ".join(problems))
    return ids.astype(np.int32)
