import pytest

from models.tiny_target import corpus

from .conftest import write_corpus


def test_excludes_tests_idlelib_generated_and_third_party(tmp_path):
    for rel in (
        "test/test_os.py",
        "idlelib/editor.py",
        "lib2to3/tests/data.py",
        "site-packages/pip/__init__.py",
        "pydoc_data/topics.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    (tmp_path / "cp_table.py").write_text('""" Codec generated with gencodec.py. """\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("y = 2\n")
    (tmp_path / "pkg" / "mod.py").write_text("z = 3\n")
    (tmp_path / "plain.py").write_text("w = 4\n")

    assert [f.module for f in corpus.list_sources(tmp_path)] == ["pkg", "pkg.mod", "plain"]


def test_split_depends_only_on_the_module_name(tmp_path):
    names = write_corpus(tmp_path, {"train": 3, "validation": 2, "heldout": 2})
    files = corpus.list_sources(tmp_path)
    assert {s: [f.module for f in files if f.split == s] for s in corpus.SPLITS} == names
    # Adding modules never moves existing ones.
    (tmp_path / "extra.py").write_text("a = 1\n")
    again = {f.module: f.split for f in corpus.list_sources(tmp_path)}
    assert all(again[f.module] == f.split for f in files)


def test_stdlib_splits_are_disjoint_and_reproducible():
    files = corpus.list_sources()
    assert len({f.module for f in files}) == len(files)
    for f in files:
        parts = f.path.relative_to(corpus.stdlib_root()).parts
        assert not {"test", "tests", "idlelib"} & set(parts), f.path
    m1, m2 = corpus.manifest(files), corpus.manifest(corpus.list_sources())
    assert m1 == m2
    sets = [set(m1[s]["modules"]) for s in corpus.SPLITS]
    assert all(sets), "every split must hold modules"
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert m1["train"]["n_files"] > 10 * m1["heldout"]["n_files"]


def test_manifest_hash_changes_with_content(tmp_path):
    write_corpus(tmp_path, {"train": 2, "validation": 1, "heldout": 1})
    before = corpus.manifest(corpus.list_sources(tmp_path))
    train_file = next(f for f in corpus.list_sources(tmp_path) if f.split == "train")
    train_file.path.write_text(train_file.path.read_text() + "# edited\n")
    after = corpus.manifest(corpus.list_sources(tmp_path))
    assert after["train"]["list_sha256"] == before["train"]["list_sha256"]
    assert after["train"]["content_sha256"] != before["train"]["content_sha256"]
    assert after["heldout"] == before["heldout"]


def test_bad_root_and_split_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        corpus.list_sources(tmp_path / "missing")
    with pytest.raises(ValueError, match="no eligible"):
        corpus.list_sources(tmp_path)
    with pytest.raises(ValueError, match="unknown split"):
        corpus.load_split([], "test")
