"""Measurements the CLI runs: policies side by side (`compare`, with `runs` and `report`), the cost table
(`costs`), timing helpers (`timing`). Argument parsing lives in `pdscope_jax.cli`."""
