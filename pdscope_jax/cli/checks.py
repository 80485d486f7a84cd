"""Argument checks shared by the commands, run before any weight loads or program compiles.

Contract: each `check_*` appends what is wrong with one option (named by its flag, with the fix) to a
`problems` list and returns nothing, or the parsed value where there is one (`check_model` -> (ModelConfig,
checkpoint directory or None), or None); a command gathers every problem and calls `errors.raise_problems(problems, "bad
arguments")`, which the CLI prints without a traceback (exit 2). Nothing here reads weights: a model is
resolved from its name or config.json only.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def check_int(problems: list[str], flag: str, value, low: int = 1, high: int | None = None) -> None:
    """`value` (None allowed: the option's default 'unset') must be an integer in [low, high]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        problems.append(f"{flag} must be an integer {span}, got {value!r}")


def check_ints(problems: list[str], flag: str, values, low: int = 1) -> None:
    """A non-empty list of integers >= low (named once, with every bad value)."""
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < low]
    if not values or bad:
        problems.append(f"{flag} takes integers >= {low}; bad: {bad or 'none given'}")


def check_number(problems: list[str], flag: str, value, low: float, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False) -> None:
    """A finite number in the interval [low, high] (open at either end when asked)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        span = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == math.inf else ']'}"
        problems.append(f"{flag} must be a finite number in {span}, got {value!r}")


def check_seed(problems: list[str], flag: str, value) -> None:
    from pdscope_jax.generation.generator import seed_problems

    problems.extend(f"{flag}: {p}" for p in seed_problems(value))


def check_size(problems: list[str], flag: str, value, positive: bool = True) -> None:
    """A byte size such as '24GB' (`runtime.parse_size`); None allowed (unset)."""
    from pdscope_jax.errors import InputError
    from pdscope_jax.runtime import parse_size

    if value is None:
        return
    try:
        if parse_size(value, flag) <= 0 and positive:
            problems.append(f"{flag} must be a positive size, got {value!r}")
    except InputError as err:
        problems.extend(err.problems)


def check_model(problems: list[str], flag: str, name: str):
    """`api.resolve(name)`: (ModelConfig, checkpoint directory or None) of a preset, embedded model, checkpoint
    directory or HF-cache name; None after adding the problem (unknown name, unreadable config.json)."""
    from pdscope_jax.api import resolve
    from pdscope_jax.config import ConfigError
    from pdscope_jax.presets import UnknownModelError

    try:
        return resolve(name)
    except (UnknownModelError, ConfigError) as err:
        problems.append(f"{flag}: {err}")
        return None


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(problems: list[str], flag: str, path: Path) -> None:
    """`path` is a folder this process can write into, or can be created (its nearest existing ancestor is a
    writable folder)."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        problems.append(f"{flag} {path} is a file, not a folder: name a folder")
        return
    base = _nearest_existing(path)
    if not base.is_dir():
        problems.append(f"{flag} {path}: {base} is a file, so the folder cannot be made there: name another folder")
    elif not os.access(base, os.W_OK | os.X_OK):
        problems.append(f"{flag} {path}: {base} is not writable by this user: name a folder you can write")


def check_writable_file(problems: list[str], flag: str, path: Path) -> None:
    """`path` can be written as a file: not a folder, and its folder is writable or can be made."""
    path = Path(path).expanduser()
    if path.is_dir():
        problems.append(f"{flag} {path} is a folder: name a file (e.g. {path / 'costs.json'})")
        return
    check_writable_dir(problems, flag, path.parent)


def check_dir(problems: list[str], flag: str, path, holds: str = "", made_by: str = "") -> bool:
    """`path` is an existing folder (holding the file `holds`, when given); False after adding the problem."""
    path = Path(path).expanduser()
    hint = f"; make it with `{made_by}`" if made_by else ""
    if not path.is_dir():
        problems.append(f"{flag} {path} is not a folder{hint}")
        return False
    if holds and not (path / holds).exists():
        problems.append(f"{flag} {path} holds no {holds}{hint}")
        return False
    return True
