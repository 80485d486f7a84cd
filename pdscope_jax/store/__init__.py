"""Where expert bytes live: the GPU budget, the expert store (pinned host copies, the only code that moves
expert weights) and the one GPU slot pool."""
