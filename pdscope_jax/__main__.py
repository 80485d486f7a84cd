"""`python -m pdscope_jax ...` is the same as the `pdscope-jax` command."""

from pdscope_jax.cli.main import entry

entry()
