"""pdscope_jax.artifacts.integrity: atomic writes, the folder swap (and its fallback's recovery), stale temporaries,
file checksums and sealed JSON."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from pdscope_jax.artifacts import integrity


class Broken(ValueError):
    pass


def test_atomic_write_returns_the_checksum_and_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "f.bin"
    digest, size = integrity.atomic_write_bytes(path, b"old")
    assert (digest, size) == (hashlib.sha256(b"old").hexdigest(), 3)

    def half_then_fail(fh):
        fh.write(b"new, half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        integrity.atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["f.bin"]


def test_json_is_streamed_and_sealed(tmp_path):
    doc = integrity.seal({"b": [1.5, 2], 3: "x", "t": (1, 2)})
    assert doc["3"] == "x" and doc["t"] == [1, 2]  # as JSON reads it back, so the seal survives the round trip
    integrity.atomic_write_json(tmp_path / "d.json", doc, indent=1)
    back = integrity.read_json(tmp_path / "d.json", Broken, "fix")
    integrity.check_seal(back, Broken, "d.json", "fix")
    back["b"][0] = 1.25
    with pytest.raises(Broken, match="d.json is corrupt or was edited.*: fix"):
        integrity.check_seal(back, Broken, "d.json", "fix")
    with pytest.raises(Broken, match="has no checksum"):
        integrity.check_seal({"a": 1}, Broken, "d.json", "fix")
    integrity.check_seal({"a": 1}, Broken, "d.json", "fix", required=False)  # unsealed, accepted when asked


def test_read_json_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(Broken, match=r"nope.json is missing: run it again"):
        integrity.read_json(tmp_path / "nope.json", Broken, "run it again")
    (tmp_path / "cut.json").write_text('{"a": [1, 2')
    with pytest.raises(Broken, match=r"cut.json is not valid JSON .* corrupt or truncated: run it again"):
        integrity.read_json(tmp_path / "cut.json", Broken, "run it again")


def test_file_checks_find_missing_short_and_changed_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_bytes(b"12345")
    (tmp_path / "y").write_bytes(b"abc")
    listed = integrity.file_digests(tmp_path)
    assert listed == {"d/x": {"bytes": 5, "sha256": hashlib.sha256(b"12345").hexdigest()},
                      "y": {"bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}}
    integrity.verify_files(tmp_path, listed, Broken, "fix")
    (tmp_path / "y").write_bytes(b"abd")
    with pytest.raises(Broken, match=r"y is corrupt: its content does not match the sha256"):
        integrity.verify_files(tmp_path, listed, Broken, "fix")
    (tmp_path / "y").write_bytes(b"ab")
    with pytest.raises(Broken, match=r"y has 2 bytes, its manifest says 3"):
        integrity.verify_files(tmp_path, listed, Broken, "fix")
    (tmp_path / "y").unlink()
    with pytest.raises(Broken, match=r"y is missing"):
        integrity.verify_files(tmp_path, listed, Broken, "fix")
    with pytest.raises(Broken, match="invalid file name"):
        integrity.verify_files(tmp_path, {"../etc/passwd": listed["d/x"]}, Broken, "fix")


def _folder(path, text):
    path.mkdir()
    (path / "v").write_text(text)


@pytest.mark.parametrize("exchange", [True, False])
def test_swap_replaces_a_folder(tmp_path, monkeypatch, exchange):
    used, real = [], integrity._exchange
    monkeypatch.setattr(integrity, "_exchange", lambda a, b: used.append(exchange and real(a, b)) or used[-1])
    target = tmp_path / "ckpt"
    _folder(target, "old")
    tmp = integrity.temp_sibling(target)
    _folder(tmp, "new")
    integrity.swap_into_place(tmp, target)
    assert (target / "v").read_text() == "new" and os.listdir(tmp_path) == ["ckpt"]
    assert used == [exchange]  # Linux: the atomic exchange itself was used


def test_a_fallback_swap_killed_between_its_renames_is_recovered(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "_exchange", lambda a, b: False)
    target = tmp_path / "ckpt"
    _folder(target, "old")
    tmp = integrity.temp_sibling(target)
    _folder(tmp, "new")
    real_rename, calls = os.rename, []

    def rename_then_die(a, b):
        calls.append(a)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_rename(a, b)

    monkeypatch.setattr(integrity.os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        integrity.swap_into_place(tmp, target)
    monkeypatch.undo()
    assert not target.exists()
    integrity.recover(target)
    assert (target / "v").read_text() == "old"


def test_remove_stale_deletes_only_what_dead_processes_left(tmp_path):
    child = subprocess.Popen(["true"])
    child.wait()
    target = tmp_path / "t.json"
    stale = tmp_path / f".t.json.tmp-{child.pid}-abcd1234"
    mine = tmp_path / f".t.json.tmp-{os.getpid()}-abcd1234"
    other = tmp_path / f".u.json.tmp-{child.pid}-abcd1234"
    for p in (stale, mine, other):
        p.write_text("x")
    integrity.remove_stale(target)
    assert not stale.exists() and mine.exists() and other.exists()
