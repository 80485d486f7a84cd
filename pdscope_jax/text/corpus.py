"""Text corpora found on any machine, split the same way everywhere, and cut into token windows.

Contract:
- `python_sources(root=None)`: the `.py` files of the running interpreter's standard library, leaving out
  `site-packages`, `__pycache__`, test folders (`test`, `tests`, `idle_test`) and two data folders (`encodings`,
  `pydoc_data`), as `Document`s sorted by '/'-separated path relative to the root; non-UTF-8 files skipped.
- `split_documents(docs, heldout_fraction, seed)`: a document is held out when the SHA-256 of
  `f"{seed}:{name}"` falls below the fraction: the split depends only on the relative path, never on file order
  or machine.
- `out_of_domain(max_chars, source=None)`: text that is not Python, from the first source of `OOD_SOURCES` that
  yields at least `MIN_OOD_CHARS` characters (the name comes with the text), or the named `source` ("cjk" too).
- `cjk_text(stdlib=None)`: the Chinese, Japanese and Korean UTF-8 samples of CPython's codec tests
  (`test/cjkencodings/*-utf8.txt`; empty where the tests are stripped): byte pieces Python source rarely makes.
- `remove_near_duplicates(docs, reference, min_chars=20)`: `docs` without the lines whose normalised form
  (`normalise_line`: whitespace runs made one space, ends stripped, case kept) has >= `min_chars` characters and
  equals a normalised line of `reference` (shorter lines are idioms, `else:`, not copied text); and the counts.
- `load_corpus(...)`: the three sets, held-out and out-of-domain without near-duplicates of train lines
  (`Corpus.dedup`); the out-of-domain source named by the argument, else by `$PDSCOPE_OOD_SOURCE`, else the
  first found. `token_stream(encode_batch, docs, eos_id)` concatenates documents' token ids, each followed by
  the end-of-text id (`tokenizer_encoder(tokenizer)` makes `encode_batch` from a `tokenizers.Tokenizer`);
  `sample_windows` and `chunk_windows` cut a stream into `[count, length]` int32 windows (seeded random
  offsets, or consecutive).

Nothing here trains a tokenizer or touches a model: callers bring the encoder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

EXCLUDED_DIRS = frozenset({"site-packages", "__pycache__", "test", "tests", "idle_test", "encodings", "pydoc_data"})
MIN_OOD_CHARS = 20_000
COMMON_LICENSES = Path("/usr/share/common-licenses")
DOC_ROOT = Path("/usr/share/doc")
NEAR_DUPLICATE_MIN_CHARS = 20
OOD_SOURCES = ("common-licenses", "doc-copyright", "stdlib-text")
OOD_SOURCE_ENV = "PDSCOPE_OOD_SOURCE"


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # '/'-separated path relative to the source's root; the split key
    text: str


@dataclasses.dataclass(frozen=True)
class Dedup:
    """What `remove_near_duplicates` took out of a set of documents."""

    lines: int  # lines before
    removed: int  # near-duplicate lines removed
    min_chars: int

    def to_json(self) -> dict:
        return {"lines": self.lines, "near_duplicate_lines_removed": self.removed,
                "fraction_removed": round(self.removed / max(self.lines, 1), 5), "min_chars": self.min_chars,
                "rule": "normalised line (whitespace runs -> one space, stripped) equal to a normalised train line"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: list[Document]
    heldout: list[Document]
    ood: list[Document]
    ood_source: str  # which out-of-domain source was found (see `out_of_domain`)
    dedup: dict[str, Dedup] = dataclasses.field(default_factory=dict)  # per evaluation split

    def summary(self) -> dict:
        def chars(docs: Sequence[Document]) -> int:
            return sum(len(d.text) for d in docs)

        return {
            "train_files": len(self.train), "train_chars": chars(self.train),
            "heldout_files": len(self.heldout), "heldout_chars": chars(self.heldout),
            "ood_source": self.ood_source, "ood_files": len(self.ood), "ood_chars": chars(self.ood),
            "dedup": {name: d.to_json() for name, d in self.dedup.items()},
        }


EncodeBatch = Callable[[list[str]], Sequence[Sequence[int]]]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def python_sources(root: Path | None = None) -> list[Document]:
    root = stdlib_root() if root is None else Path(root)
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        text = _read(path)
        if text:
            docs.append(Document(rel.as_posix(), text))
    return docs


def is_heldout(name: str, heldout_fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < heldout_fraction


def split_documents(docs: Sequence[Document], heldout_fraction: float = 0.05,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    train, heldout = [], []
    for doc in docs:
        (heldout if is_heldout(doc.name, heldout_fraction, seed) else train).append(doc)
    return train, heldout


def normalise_line(line: str) -> str:
    return " ".join(line.split())


def remove_near_duplicates(docs: Sequence[Document], reference: Sequence[Document],
                           min_chars: int = NEAR_DUPLICATE_MIN_CHARS) -> tuple[list[Document], Dedup]:
    known = {normalise_line(line) for doc in reference for line in doc.text.splitlines()}
    kept, lines, removed = [], 0, 0
    for doc in docs:
        keep = []
        for line in doc.text.splitlines(keepends=True):
            norm = normalise_line(line)
            lines += 1
            if len(norm) >= min_chars and norm in known:
                removed += 1
            else:
                keep.append(line)
        if keep:
            kept.append(Document(doc.name, "".join(keep)))
    return kept, Dedup(lines, removed, min_chars)


def _collect_text(paths: Sequence[Path], root: Path, max_chars: int) -> list[Document]:
    docs, total, seen = [], 0, set()
    for path in paths:
        try:
            real = path.resolve()
        except OSError:
            continue
        if real in seen or not real.is_file():
            continue  # common-licenses holds symlinks (GPL -> GPL-3); read each file once
        seen.add(real)
        text = _read(real)
        if not text:
            continue
        text = text[: max_chars - total]
        docs.append(Document(path.relative_to(root).as_posix(), text))
        total += len(text)
        if total >= max_chars:
            break
    return docs


def out_of_domain(max_chars: int = 2_000_000, stdlib: Path | None = None,
                  common_licenses: Path = COMMON_LICENSES,
                  doc_root: Path = DOC_ROOT, source: str | None = None) -> tuple[str, list[Document]]:
    """(source name, documents) of the first source with at least `MIN_OOD_CHARS` characters, in this order:
    1. "common-licenses": `/usr/share/common-licenses/*` (Debian/Ubuntu `base-files`, always installed);
    2. "doc-copyright": `/usr/share/doc/*/copyright` (dpkg docs; removed on some slim images);
    3. "stdlib-text": the interpreter's own non-Python text files (`LICENSE.txt`, `*.txt`, `*.rst` anywhere
       under the stdlib, test data included: none of it is Python source);
    4. "none": an empty list, when nothing above exists.
    `source` (one of `OOD_SOURCES` or "cjk", `cjk_text`) takes that source alone, whatever its size."""
    if source == "cjk":
        return source, cjk_text(stdlib)
    if source is not None and source not in OOD_SOURCES:
        raise ValueError(f"out-of-domain source {source!r} is not one of {OOD_SOURCES + ('cjk',)}")
    stdlib = stdlib_root() if stdlib is None else Path(stdlib)
    candidates = [
        ("common-licenses", common_licenses,
         lambda: sorted(common_licenses.iterdir()) if common_licenses.is_dir() else []),
        ("doc-copyright", doc_root, lambda: sorted(doc_root.glob("*/copyright")) if doc_root.is_dir() else []),
        ("stdlib-text", stdlib,
         lambda: sorted(p for pattern in ("LICENSE*", "*.txt", "*.rst") for p in stdlib.rglob(pattern)
                        if "site-packages" not in p.relative_to(stdlib).parts)),
    ]
    for name, root, list_paths in candidates:
        if source in (None, name):
            docs = _collect_text(list_paths(), root, max_chars)
            if source == name or sum(len(d.text) for d in docs) >= MIN_OOD_CHARS:
                return name, docs
    return "none", []


def cjk_text(stdlib: Path | None = None) -> list[Document]:
    root = stdlib_root() if stdlib is None else Path(stdlib)
    return _collect_text(sorted((root / "test" / "cjkencodings").glob("*-utf8.txt")), root, 2_000_000)


def load_corpus(heldout_fraction: float = 0.05, seed: int = 0, max_files: int | None = None,
                max_ood_chars: int = 2_000_000, root: Path | None = None, dedup: bool = True,
                ood_source: str | None = None) -> Corpus:
    """The stdlib Python split into train/held-out, plus out-of-domain text (`ood_source`, else the variable
    `OOD_SOURCE_ENV`, else the first source found), both without near-duplicates of train lines unless
    `dedup` is False.

    `max_files` keeps the first files of each split by path (a small, still deterministic subset) and
    caps the out-of-domain set to as many documents.
    """
    train, heldout = split_documents(python_sources(root), heldout_fraction, seed)
    ood_source, ood = out_of_domain(max_ood_chars, stdlib=root,
                                    source=ood_source or os.environ.get(OOD_SOURCE_ENV) or None)
    if max_files is not None:
        train, heldout, ood = train[:max_files], heldout[:max(1, max_files // 10)], ood[:max_files]
    removed = {}
    if dedup:
        heldout, removed["heldout"] = remove_near_duplicates(heldout, train)
        ood, removed["ood"] = remove_near_duplicates(ood, train)
    return Corpus(train, heldout, ood, ood_source, removed)


def tokenizer_encoder(tokenizer) -> EncodeBatch:
    """`encode_batch` of a `tokenizers.Tokenizer` (parallel over documents)."""
    return lambda texts: [enc.ids for enc in tokenizer.encode_batch(texts)]


def token_stream(encode_batch: EncodeBatch, docs: Sequence[Document], eos_id: int) -> np.ndarray:
    """All documents' token ids in order, each followed by `eos_id`: [total] int32."""
    parts = []
    for ids in encode_batch([d.text for d in docs]):
        parts.append(np.asarray(ids, dtype=np.int32))
        parts.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def sample_windows(stream: np.ndarray, length: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` windows of `length` tokens at uniformly random offsets: [count, length] int32."""
    if len(stream) < length:
        raise ValueError(f"a stream of {len(stream)} tokens has no window of {length}")
    starts = rng.integers(0, len(stream) - length + 1, size=count)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def chunk_windows(stream: np.ndarray, length: int, max_count: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows from the start: [min(len // length, max_count), length] int32."""
    count = len(stream) // length
    if max_count is not None:
        count = min(count, max_count)
    return stream[: count * length].reshape(count, length).astype(np.int32)
