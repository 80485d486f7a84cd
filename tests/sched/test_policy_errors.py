"""An unknown policy name is the project's own error (still a ValueError), naming the known ones."""

import pytest

from pdscope_jax.errors import InputError
from pdscope_jax.sched import POLICIES, UnknownPolicyError, check_policy, make_planner, planner_class


def test_unknown_policy_is_an_input_error_naming_every_policy():
    for call in (make_planner, planner_class, check_policy):
        with pytest.raises(UnknownPolicyError, match="unknown policy 'nosuch'; known: " + ", ".join(POLICIES)):
            call("nosuch")
    assert issubclass(UnknownPolicyError, InputError) and issubclass(UnknownPolicyError, ValueError)
    with pytest.raises(UnknownPolicyError):
        check_policy(None)
