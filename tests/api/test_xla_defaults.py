"""pdscope_jax.xla_defaults: the package's XLA flags join XLA_FLAGS unless the user named them or opted out."""

from pdscope_jax import XLA_DEFAULTS, xla_defaults

FLAG = "--xla_gpu_enable_command_buffer"


def test_defaults_are_added_to_what_the_user_set():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    xla_defaults(env)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", f"{FLAG}="]
    assert XLA_DEFAULTS == {FLAG: ""}


def test_defaults_alone_when_xla_flags_is_unset():
    env = {}
    xla_defaults(env)
    assert env == {"XLA_FLAGS": f"{FLAG}="}


def test_a_flag_the_user_named_wins_and_is_not_repeated():
    env = {"XLA_FLAGS": f"{FLAG}=FUSION,CUBLAS"}
    xla_defaults(env)
    assert env["XLA_FLAGS"] == f"{FLAG}=FUSION,CUBLAS"


def test_opting_out_leaves_xla_flags_alone():
    env = {"PDSCOPE_XLA_DEFAULTS": "0", "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    xla_defaults(env)
    assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    env = {"PDSCOPE_XLA_DEFAULTS": "0"}
    xla_defaults(env)
    assert "XLA_FLAGS" not in env


def test_importing_the_package_set_the_flag_in_this_process():
    import os

    if os.environ.get("PDSCOPE_XLA_DEFAULTS") != "0":
        assert any(word.startswith(FLAG + "=") for word in os.environ["XLA_FLAGS"].split())
