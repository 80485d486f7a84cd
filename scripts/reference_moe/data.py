"""Corpus -> tokenizer -> token streams -> windows, for the reference MoE's training and evaluation.

`prepare` loads the corpus (`pdscope_jax.text.corpus`: stdlib `.py` files split into train / held-out by path
hash, plus out-of-domain text), trains a byte-level BPE tokenizer on the train split with `EOS` (id 0) as its
only special token, encodes each split into one token stream (documents separated by `EOS`), and cuts the
held-out and out-of-domain streams into fixed evaluation batches. Pure host-side work (numpy, tokenizers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer, decoders, models as bpe_models, pre_tokenizers, trainers

from pdscope_jax.text import corpus

EOS = "<|endoftext|>"
HELDOUT_FRACTION = 0.05


@dataclass
class Data:
    """corpus: the loaded splits; tok: the trained tokenizer; streams: split name ("train", "heldout", "ood")
    -> int token stream; evals: "heldout" / "ood" -> [count, batch, seq_len + 1] windows (a split shorter than
    one window has no entry)."""

    corpus: corpus.Corpus
    tok: Tokenizer
    streams: dict[str, np.ndarray]
    evals: dict[str, np.ndarray]


def train_tokenizer(docs: list[corpus.Document], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with `vocab_size` entries trained on `docs`; `EOS` is the only special token (id 0)."""
    tok = Tokenizer(bpe_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([d.text for d in docs], trainer)
    return tok


def eval_batches(stream: np.ndarray, length: int, windows: int, batch: int) -> np.ndarray:
    """Consecutive windows [count, batch, length]; at least one batch (short texts repeat their windows)."""
    w = corpus.chunk_windows(stream, length, windows)
    if len(w) < batch:
        w = np.resize(w, (batch, length))
    count = len(w) // batch
    return w[: count * batch].reshape(count, batch, length)


def prepare(vocab_size: int, seq_len: int, eval_windows: int, batch: int, seed: int, smoke: bool) -> Data:
    """The corpus split by `seed` (`smoke`: a 40-file subset), its tokenizer and streams, and evaluation
    batches of `eval_windows` windows of `seq_len + 1` tokens; prints a summary of each."""
    data = corpus.load_corpus(heldout_fraction=HELDOUT_FRACTION, seed=seed, max_files=40 if smoke else None)
    print(f"corpus: {data.summary()} (out-of-domain source: {data.ood_source})", flush=True)
    tok = train_tokenizer(data.train, vocab_size)
    eos = tok.token_to_id(EOS)
    streams = {name: corpus.token_stream(corpus.tokenizer_encoder(tok), docs, eos)
               for name, docs in (("train", data.train), ("heldout", data.heldout), ("ood", data.ood))}
    length = seq_len + 1
    evals = {name: eval_batches(streams[name], length, eval_windows, batch) for name in ("heldout", "ood")
             if len(streams[name]) >= length}
    print("tokens: " + ", ".join(f"{k} {len(v):,}" for k, v in streams.items()), flush=True)
    return Data(data, tok, streams, evals)
