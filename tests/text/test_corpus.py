import random

import numpy as np
import pytest

from pdscope_jax.text import corpus
from pdscope_jax.text.corpus import Document


def _tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_python_sources_skip_tests_site_packages_data_and_bad_utf8(tmp_path):
    _tree(tmp_path, {
        "os.py": "import sys\n", "json/decoder.py": "x = 1\n", "json/README.txt": "not python",
        "test/test_os.py": "t", "unittest/test/test_case.py": "t", "lib2to3/tests/data.py": "t",
        "idlelib/idle_test/t.py": "t", "site-packages/pkg/mod.py": "t", "encodings/cp437.py": "t",
        "pydoc_data/topics.py": "t", "__pycache__/os.py": "t", "empty.py": "",
    })
    (tmp_path / "latin1.py").write_bytes(b"x = '\xe9'\n")
    docs = corpus.python_sources(tmp_path)
    assert [d.name for d in docs] == ["json/decoder.py", "os.py"]
    assert docs[1].text == "import sys\n"


def test_split_depends_only_on_names():
    docs = [Document(f"pkg{i // 10}/mod{i}.py", "x") for i in range(2000)]
    train, heldout = corpus.split_documents(docs, 0.05, seed=0)
    assert len(train) + len(heldout) == len(docs)
    assert 60 <= len(heldout) <= 140  # about 5%
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    _, heldout2 = corpus.split_documents(shuffled, 0.05, seed=0)
    assert {d.name for d in heldout2} == {d.name for d in heldout}
    _, other_seed = corpus.split_documents(docs, 0.05, seed=1)
    assert {d.name for d in other_seed} != {d.name for d in heldout}


def test_split_is_the_same_on_every_machine():
    # SHA-256 of "seed:name": fixed values, whatever the interpreter, platform or file order.
    assert [corpus.is_heldout(n, 0.05, 0) for n in ("os.py", "typing.py", "json/decoder.py", "abc.py")] == \
        [False, True, False, True]
    assert corpus.is_heldout("asyncio/tasks.py", 0.5, 0) and not corpus.is_heldout("asyncio/tasks.py", 0.05, 0)


def test_stdlib_corpus_is_found():
    data = corpus.load_corpus(max_files=5)
    assert len(data.train) == 5 and data.heldout
    assert all(d.name.endswith(".py") for d in data.train + data.heldout)
    assert data.ood_source in ("common-licenses", "doc-copyright", "stdlib-text", "none")
    assert data.summary()["train_files"] == 5


def test_out_of_domain_falls_back_in_order(tmp_path):
    big = "Permission is hereby granted. " * 1000  # over MIN_OOD_CHARS
    licenses, docs, stdlib = tmp_path / "licenses", tmp_path / "doc", tmp_path / "stdlib"
    _tree(licenses, {"MIT": big})
    (licenses / "MIT-link").symlink_to(licenses / "MIT")
    _tree(docs, {"pkg/copyright": big, "pkg/changelog": "x"})
    _tree(stdlib, {"LICENSE.txt": big, "mod.py": "x = 1\n", "site-packages/x/LICENSE.txt": big})

    def ood(**paths):
        kw = dict(stdlib=stdlib, common_licenses=licenses, doc_root=docs)
        kw.update(paths)
        return corpus.out_of_domain(**kw)

    source, found = ood()
    assert source == "common-licenses" and [d.name for d in found] == ["MIT"]  # the symlink is read once
    source, found = ood(common_licenses=tmp_path / "missing")
    assert source == "doc-copyright" and [d.name for d in found] == ["pkg/copyright"]
    source, found = ood(common_licenses=tmp_path / "missing", doc_root=tmp_path / "missing")
    assert source == "stdlib-text" and [d.name for d in found] == ["LICENSE.txt"]
    assert ood(common_licenses=tmp_path / "missing", doc_root=tmp_path / "missing",
               stdlib=tmp_path / "missing")[0] == "none"
    source, found = ood(max_chars=100)
    assert source == "none"  # too little text in every source once capped below MIN_OOD_CHARS
    assert sum(len(d.text) for d in corpus.out_of_domain(max_chars=30_000, common_licenses=licenses,
                                                          stdlib=stdlib, doc_root=docs)[1]) == 30_000


def test_token_stream_and_windows():
    docs = [Document("a", "ab"), Document("b", "cde")]
    stream = corpus.token_stream(lambda texts: [[ord(c) for c in t] for t in texts], docs, eos_id=0)
    assert stream.tolist() == [97, 98, 0, 99, 100, 101, 0] and stream.dtype == np.int32
    chunks = corpus.chunk_windows(np.arange(10), 3)
    assert chunks.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert corpus.chunk_windows(np.arange(10), 3, max_count=2).shape == (2, 3)
    w1 = corpus.sample_windows(np.arange(100), 8, 5, np.random.default_rng(3))
    w2 = corpus.sample_windows(np.arange(100), 8, 5, np.random.default_rng(3))
    assert w1.shape == (5, 8) and (w1 == w2).all()
    assert (np.diff(w1, axis=1) == 1).all()  # contiguous slices of the stream
    with pytest.raises(ValueError, match="no window"):
        corpus.sample_windows(np.arange(4), 8, 1, np.random.default_rng(0))


def test_cjk_text_reads_the_utf8_codec_samples_only(tmp_path):
    samples = tmp_path / "test" / "cjkencodings"
    samples.mkdir(parents=True)
    (samples / "gb2312-utf8.txt").write_text("中文样本", encoding="utf-8")
    (samples / "gb2312.txt").write_bytes("中文样本".encode("gb2312"))  # the encoded twin: not UTF-8, not read
    docs = corpus.cjk_text(tmp_path)
    assert [(d.name, d.text) for d in docs] == [("test/cjkencodings/gb2312-utf8.txt", "中文样本")]
    assert corpus.cjk_text(tmp_path / "elsewhere") == []


def test_near_duplicate_lines_of_the_train_text_leave_the_evaluation_text():
    train = [Document("a.py", "def f(x):\n    return helper(x, flag=True)  \nelse:\n")]
    heldout = [Document("b.py", "else:\nreturn   helper(x, flag=True)\nreturn helper(y, flag=True)\n"),
               Document("c.py", "  return helper(x, flag=True)\n")]
    kept, dedup = corpus.remove_near_duplicates(heldout, train)
    # whitespace differences still match; the short idiom `else:` (under 20 characters) stays; c.py had nothing else
    assert [(d.name, d.text) for d in kept] == [("b.py", "else:\nreturn helper(y, flag=True)\n")]
    assert (dedup.lines, dedup.removed) == (4, 2) and dedup.to_json()["fraction_removed"] == 0.5


def test_a_named_out_of_domain_source_is_taken_alone(tmp_path, monkeypatch):
    _tree(tmp_path, {"licenses/MIT": "Permission is hereby granted. " * 1000,
                     "stdlib/test/cjkencodings/gb2312-utf8.txt": "中文样本"})
    kw = dict(stdlib=tmp_path / "stdlib", common_licenses=tmp_path / "licenses", doc_root=tmp_path / "doc")
    assert corpus.out_of_domain(**kw)[0] == "common-licenses"
    source, docs = corpus.out_of_domain(**kw, source="cjk")
    assert source == "cjk" and [d.text for d in docs] == ["中文样本"]
    with pytest.raises(ValueError, match="not one of"):
        corpus.out_of_domain(**kw, source="klingon")
    monkeypatch.setenv(corpus.OOD_SOURCE_ENV, "cjk")
    data = corpus.load_corpus(max_files=3, root=tmp_path / "stdlib")
    assert data.ood_source == "cjk" and set(data.dedup) == {"heldout", "ood"}
