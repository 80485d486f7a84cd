"""`python -m pdscope_jax ...` is the same as the `pdscope-jax` command."""

import sys

from pdscope_jax.cli.main import main

sys.exit(main())
