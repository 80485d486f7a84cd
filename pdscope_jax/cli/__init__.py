"""The `pdscope-jax` command line: `main` dispatches to one module per command; each parses its arguments and
calls the library (`api`, `bench`, `phaseper`), which never imports this folder."""
