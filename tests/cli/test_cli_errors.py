"""CLI errors: a user error is a few lines without a traceback and exit 2; an internal error keeps its
traceback and exits 1; `--debug` shows the traceback of both."""

import pdscope_jax.cli.run as run_command
from pdscope_jax.cli import main as cli


def test_unknown_policy_is_a_user_error_without_traceback(capsys):
    assert cli.main(["generate", "tiny-deepseek-v2-lite", "--policy", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown policy 'nosuch'; known: gpu" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 3


def test_bad_ids_are_a_user_error_before_loading(capsys, monkeypatch):
    import pdscope_jax.api

    monkeypatch.setattr(pdscope_jax.api, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert cli.main(["generate", "tiny-deepseek-v2-lite", "--ids", f"1,{3 + 2**32}"]) == 2
    err = capsys.readouterr().err
    assert "token ids must lie in [0, 256)" in err and "Traceback" not in err


def test_debug_shows_the_traceback_of_a_user_error(capsys):
    assert cli.main(["--debug", "generate", "tiny-deepseek-v2-lite", "--policy", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "unknown policy 'nosuch'" in err


def test_internal_error_keeps_its_traceback_and_exits_1(capsys, monkeypatch):
    def broken(argv):
        raise RuntimeError("a bug")

    monkeypatch.setattr(run_command, "main", broken)
    assert cli.main(["run"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug" in err and "internal error" in err
