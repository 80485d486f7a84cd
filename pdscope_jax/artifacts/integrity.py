"""Integrity of the files the project writes and reads back: atomic writes and sha256 checksums.

Contract
- Writes never leave a half-written file under the final name. `atomic_write(path, fill) -> (sha256, bytes)`
  calls `fill(fh)` on a temporary sibling `.<name>.tmp-<pid>-<rand>`, fsyncs it, `os.replace`s it over `path`
  and fsyncs the folder; `atomic_write_bytes` / `atomic_write_json` are the common cases. A process killed at
  any moment leaves either the old file or the new one.
- Folders: build the new one in `temp_sibling(target)`, then `swap_into_place(tmp, target)`: on Linux one
  `renameat2(RENAME_EXCHANGE)` swaps the two atomically; elsewhere the old folder moves aside
  (`.<name>.old-<pid>-<rand>`) first and `recover(target)` (called by loaders) moves it back when a kill
  struck between the two renames. `remove_stale(target)` deletes the temporary and old siblings of dead processes.
- Checksums are sha256 (hashlib/OpenSSL: the SHA extensions of current CPUs make it about twice blake2b's speed,
  and `sha256sum FILE` checks a file from a shell). `file_digests(folder)` -> {relative path: {"bytes",
  "sha256"}} and `verify_files(folder, listed, error, remedy)` check every listed file (absent, wrong size,
  wrong content), naming each bad file and the command that makes it again.
- A JSON document seals itself: `seal(doc)` adds "checksum", the sha256 of its canonical JSON without that key;
  `check_seal(doc, error, where, remedy)` raises `error` on a mismatch. `read_json(path, error, remedy)` reads a
  JSON file (missing, unreadable, not JSON -> `error`). Each caller passes its room's error type.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable

CHECKSUM_KEY = "checksum"
_CHUNK = 1 << 20
_TMP, _OLD = ".tmp-", ".old-"


def sha256_file(path: Path) -> tuple[str, int]:
    """(hex sha256, byte count) of a file, read in 1 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through it."""

    def __init__(self, fh: BinaryIO):
        self.fh, self.digest, self.size = fh, hashlib.sha256(), 0

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        self.digest.update(data)
        self.size += len(data)
        return self.fh.write(data)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms that cannot open a folder: the rename is as durable as they allow
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sibling(target: Path, mark: str) -> Path:
    return target.with_name(f".{target.name}{mark}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def temp_sibling(target: Path) -> Path:
    """A fresh hidden sibling name for building a new version of `target` (never loaded as `target`)."""
    return _sibling(Path(target), _TMP)


def is_temporary(path: Path) -> bool:
    return Path(path).name.startswith(".") and (_TMP in path.name or _OLD in path.name)


def atomic_write(path: str | Path, fill: Callable[[Any], None]) -> tuple[str, int]:
    """Write `path` through `fill(fh)` (a binary writer) atomically; returns (sha256, bytes) of the content."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as fh:
            writer = _HashingWriter(fh)
            fill(writer)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return writer.digest.hexdigest(), writer.size


def atomic_write_bytes(path: str | Path, data: bytes) -> tuple[str, int]:
    return atomic_write(path, lambda fh: fh.write(data))


def atomic_write_json(path: str | Path, doc: Any, indent: int | None = None) -> tuple[str, int]:
    """`doc` as JSON (no NaN or infinity; `indent=None` uses the fast C encoder), written atomically."""
    return atomic_write_bytes(path, json.dumps(doc, indent=indent, allow_nan=False).encode())


# ---- folders --------------------------------------------------------------------------------------------------

def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where that is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # kernel or file system without the exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_into_place(tmp: Path, target: Path) -> None:
    """Make the complete folder `tmp` the folder `target`; the old `target` (if any) is deleted afterwards."""
    tmp, target = Path(tmp), Path(target)
    if not target.exists():
        os.rename(tmp, target)
    elif _exchange(tmp, target):
        shutil.rmtree(tmp)  # now holds the old version
    else:
        old = _sibling(target, _OLD)
        os.rename(target, old)
        os.rename(tmp, target)  # a kill between the two renames: `recover` moves `old` back
        shutil.rmtree(old)
    _fsync_dir(target.parent)


def recover(target: Path) -> None:
    """Move the old version back when a fallback swap was killed between its renames (target absent)."""
    target = Path(target)
    if target.exists() or not target.parent.is_dir():
        return
    olds = sorted(target.parent.glob(f".{target.name}{_OLD}*"), key=lambda p: p.stat().st_mtime)
    if olds:
        os.rename(olds[-1], target)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(target: Path) -> None:
    """Delete temporary / old siblings of `target` left by processes that no longer run."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    for mark in (_TMP, _OLD):
        for path in target.parent.glob(f".{target.name}{mark}*"):
            pid = path.name[len(f".{target.name}{mark}"):].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


# ---- checksums --------------------------------------------------------------------------------------------------

def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """{path relative to `folder` (POSIX): {"bytes": n, "sha256": hex}} of every file below it, sorted."""
    folder = Path(folder)
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest, size = sha256_file(path)
        out[path.relative_to(folder).as_posix()] = {"bytes": size, "sha256": digest}
    return out


def _check_entry(path: Path, entry: Any, size: int, digest: Callable[[], str], error: type[Exception],
                 remedy: str) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or not isinstance(
            entry.get("bytes"), int):
        raise error(f"{path}: the manifest has no valid checksum for it ({entry!r}): {remedy}")
    if size != entry["bytes"]:
        raise error(f"{path} has {size} bytes, its manifest says {entry['bytes']} (truncated or overwritten): "
                    f"{remedy}")
    if digest() != entry["sha256"]:
        raise error(f"{path} is corrupt: its content does not match the sha256 its manifest lists: {remedy}")


def verify_file(path: Path, entry: Any, error: type[Exception], remedy: str) -> None:
    """Raise `error` unless `path` exists with the size and sha256 of `entry` ({"bytes", "sha256"})."""
    if not path.is_file():
        raise error(f"{path} is missing (its manifest lists it): {remedy}")
    _check_entry(path, entry, path.stat().st_size, lambda: sha256_file(path)[0], error, remedy)


def verify_bytes(path: Path, data: bytes, entry: Any, error: type[Exception], remedy: str) -> None:
    """`verify_file` for the bytes already read from `path`."""
    _check_entry(path, entry, len(data), lambda: hashlib.sha256(data).hexdigest(), error, remedy)


def verify_files(folder: Path, listed: Any, error: type[Exception], remedy: str) -> None:
    """Check every file of a `file_digests` listing below `folder` (extra files are ignored)."""
    if not isinstance(listed, dict) or not listed:
        raise error(f"{folder}: the manifest lists no files with checksums: {remedy}")
    for name, entry in listed.items():
        if not isinstance(name, str) or name.startswith("/") or ".." in Path(name).parts:
            raise error(f"{folder}: the manifest lists an invalid file name {name!r}: {remedy}")
        verify_file(Path(folder) / name, entry, error, remedy)


def _canonical(doc: dict) -> bytes:
    body = {k: v for k, v in doc.items() if k != CHECKSUM_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def seal(doc: dict) -> dict:
    """`doc` as JSON reads it back (tuples as lists, keys as strings) with "checksum": the sha256 of its
    canonical JSON (sorted keys, no spaces) without that key."""
    doc = json.loads(json.dumps(doc, allow_nan=False))
    return {**doc, CHECKSUM_KEY: hashlib.sha256(_canonical(doc)).hexdigest()}


def check_seal(doc: Any, error: type[Exception], where: str | Path, remedy: str, required: bool = True) -> None:
    """Raise `error` when `doc` is not a sealed JSON object whose checksum matches (a missing checksum only
    when `required`)."""
    if not isinstance(doc, dict):
        raise error(f"{where}: expected a JSON object, got {type(doc).__name__}: {remedy}")
    if CHECKSUM_KEY not in doc:
        if required:
            raise error(f"{where} has no checksum (written by an older version, or edited): {remedy}")
        return
    try:
        want = hashlib.sha256(_canonical(doc)).hexdigest()
    except (TypeError, ValueError) as err:
        raise error(f"{where} cannot be checked ({err}): {remedy}") from None
    if doc[CHECKSUM_KEY] != want:
        raise error(f"{where} is corrupt or was edited: its content does not match its checksum: {remedy}")


def read_json(path: Path, error: type[Exception], remedy: str) -> Any:
    """The JSON value in `path`; a missing or unreadable file, or text that is not JSON, raises `error`."""
    try:
        return json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise error(f"{path} is missing: {remedy}") from None
    except OSError as err:
        raise error(f"{path} cannot be read ({err.strerror}): {remedy}") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise error(f"{path} is not valid JSON ({err}): it is corrupt or truncated: {remedy}") from None
