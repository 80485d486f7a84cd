"""The project's own error for bad caller input, at the lowest floor so every room can raise it.

Contract: `InputError(ValueError)` means "the caller gave something that cannot be used"; its message names
every problem found (not only the first) and how to fix each; `.problems` lists them one by one. Entry points
collect problems into a list (`collect` runs a check and adds the problems of the InputError it raises) and
call `raise_problems(problems, what)`, which raises nothing for an empty list. The CLI prints an InputError
(and its subclasses: `runtime.RuntimeConfigError`, `store.budget.BudgetError`, `sched.registry.UnknownPolicyError`)
as a few lines without a traceback and exits 2. It subclasses ValueError so `except ValueError` still catches it.
"""

from __future__ import annotations


class InputError(ValueError):
    """A caller's input that cannot be used; the message names every problem and its fix."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


def collect(problems: list[str], check, *args, **kwargs):
    """`check(*args, **kwargs)`, or None after adding the problems of the InputError it raised to `problems`."""
    try:
        return check(*args, **kwargs)
    except InputError as e:
        problems.extend(e.problems)
        return None


def raise_problems(problems: list[str], what: str) -> None:
    """Raise one InputError naming every problem of `what` (e.g. "generate"); nothing when `problems` is empty."""
    if not problems:
        return
    if len(problems) == 1:
        raise InputError(f"{what}: {problems[0]}", problems)
    raise InputError(f"{what}: {len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems), problems)
