"""Measurements the CLI runs: policies side by side (`compare`), the cost table (`profile`), timing helpers."""
