"""The stages of `scripts/train_reference_moe.py` (the entry point, which owns the flags and the results JSON).

- `data`: corpus -> byte-level BPE tokenizer -> token streams -> windows for training and evaluation.
- `train`: model initialisation, loss (cross-entropy + expert balance), optimizer, schedule, the training loop.
- `checkpoint`: Hugging Face export of the trained weights and the checks run on what was saved (reload
  logits, routing statistics, generations) plus the loss/routing plot.
Imported as the top-level package `reference_moe`: the entry point puts its own folder first on sys.path.
"""
