"""The `pdscope-jax` command line: `main` dispatches to one module per command."""
