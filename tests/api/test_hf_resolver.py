"""The Hugging Face cache resolver: the snapshot refs/main (or a revision) names, never the newest by mtime."""

import os
import shutil
from pathlib import Path

import pytest

from pdscope_jax.api import find_in_hf_cache, resolve
from pdscope_jax.presets import UnknownModelError

DATA = Path(__file__).resolve().parents[1] / "data" / "mixtral"


def _repo(hub: Path, commits: list[str], main: str | None) -> Path:
    """A cached repo acme/tiny with one snapshot per commit (the last written newest) and refs/main -> `main`."""
    repo = hub / "models--acme--tiny"
    for i, commit in enumerate(commits):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        shutil.copy(DATA / "config.json", snapshot / "config.json")
        os.utime(snapshot, (1_000_000 + i, 1_000_000 + i))
    if main is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main + "\n")
    return repo


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_refs_main_wins_over_the_newest_snapshot(hub):
    repo = _repo(hub, ["aaa111", "bbb222"], main="aaa111")
    assert find_in_hf_cache("acme/tiny") == repo / "snapshots" / "aaa111"
    cfg, path = resolve("acme/tiny")
    assert path == repo / "snapshots" / "aaa111" and cfg.name == "acme/tiny"


def test_revision_picks_a_ref_or_a_commit(hub):
    repo = _repo(hub, ["aaa111", "bbb222"], main="aaa111")
    (repo / "refs" / "v2").write_text("bbb222")
    assert find_in_hf_cache("acme/tiny", "v2") == repo / "snapshots" / "bbb222"
    assert resolve("acme/tiny", "bbb222")[1] == repo / "snapshots" / "bbb222"


def test_missing_revision_names_the_cached_snapshots_and_the_fix(hub):
    _repo(hub, ["aaa111", "bbb222"], main="ccc333")  # refs/main points at a snapshot not downloaded
    with pytest.raises(UnknownModelError, match=r"'main' \(ccc333\).*aaa111, bbb222.*pdscope-jax download acme/tiny"):
        resolve("acme/tiny")
    with pytest.raises(UnknownModelError, match="revision 'v9'"):
        resolve("acme/tiny", "v9")


def test_without_refs_one_snapshot_is_used_and_several_are_refused(hub):
    repo = _repo(hub, ["aaa111"], main=None)
    assert find_in_hf_cache("acme/tiny") == repo / "snapshots" / "aaa111"
    shutil.copytree(repo / "snapshots" / "aaa111", repo / "snapshots" / "bbb222")
    with pytest.raises(UnknownModelError, match="no refs/main and 2 snapshots.*--revision"):
        find_in_hf_cache("acme/tiny")


def test_unknown_hub_name_suggests_download(hub):
    with pytest.raises(UnknownModelError, match="pdscope-jax download acme/absent"):
        resolve("acme/absent")
