"""The Debian description corpus builder: parsing, pairing and splitting (no network)."""

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples" / "translation"))
import prepare_debian as pd  # noqa: E402

# Hand-written stanzas in the index format (not archive data).
EN = """Package: foo-utils
Description-md5: aaa
Description-en: tools for foo
 Foo tools read foo files
 and write bar files.
 .
 This package holds the tools.

Package: libfoo-dev
Description-md5: bbb
Description-en: foo library - development files
 Headers for foo.
 .
 Second paragraph.
 .
 Third paragraph.

Package: orphan
Description-md5: ccc
Description-en: only in English
"""
DE = """Package: foo-utils
Description-md5: aaa
Description-de: Werkzeuge für foo
 Foo-Werkzeuge lesen foo-Dateien
 und schreiben bar-Dateien.
 .
 Dieses Paket enthält die Werkzeuge.

Package: libfoo-dev
Description-md5: bbb
Description-de: foo-Bibliothek - Entwicklungsdateien
 Header für foo.
"""


def test_split_description_into_short_and_paragraphs():
    short, paras = pd.split_description("tools for foo\n Foo tools read foo files\n and write bar files.\n .\n This package holds the tools.")
    assert short == "tools for foo"
    assert paras == ["Foo tools read foo files and write bar files.", "This package holds the tools."]


def test_pairs_by_md5_short_always_long_only_when_paragraphs_match():
    pairs = pd.pair_descriptions(pd.descriptions(EN, "en"), pd.descriptions(DE, "de"))
    assert pairs == [
        ("tools for foo", "Werkzeuge für foo", "foo-utils"),
        ("Foo tools read foo files and write bar files.", "Foo-Werkzeuge lesen foo-Dateien und schreiben bar-Dateien.", "foo-utils"),
        ("This package holds the tools.", "Dieses Paket enthält die Werkzeuge.", "foo-utils"),
        # bbb: 3 English paragraphs against 1 German one: only the short descriptions pair
        ("foo library - development files", "foo-Bibliothek - Entwicklungsdateien", "libfoo-dev"),
    ]


def test_package_families_group_variants_together():
    fams = {pd.package_family(p) for p in ("foo-utils", "libfoo-dev", "libfoo2", "python3-foo", "foo-doc")}
    assert fams == {"foo"}
    assert pd.package_family("bar") != "foo"


def test_split_is_deterministic_by_group_and_sized():
    groups = [f"pkg{i}" for i in range(4000)]
    splits = [pd.split_of(g, 2.0, 3.0) for g in groups]
    assert splits == [pd.split_of(g, 2.0, 3.0) for g in groups]
    frac = {s: splits.count(s) / len(splits) for s in ("train", "valid", "test")}
    assert 0.02 < frac["test"] < 0.04 and 0.01 < frac["valid"] < 0.03


def test_write_splits_keeps_a_family_in_one_split(tmp_path):
    pairs = [(f"s{i}", f"t{i}", name) for i, name in enumerate(["libzap-dev", "zap", "zap-doc"] * 20)]
    counts = pd.write_splits(pairs, tmp_path, "de", 30.0, 30.0)
    assert sorted(counts.values()) == [0, 0, 60]


def test_filter_train_keeps_pairs_short_on_both_sides(tmp_path):
    (tmp_path / "train.en").write_text("a b\na b c d\na\na b c\n")
    (tmp_path / "train.de").write_text("x y z\nx\nx y z w\ny\n")
    prefix, kept, total = pd.filter_train(tmp_path, "de", 3)
    assert (prefix, kept, total) == ("train.max3", 2, 4)
    assert (tmp_path / "train.max3.en").read_text() == "a b\na b c\n"
    assert (tmp_path / "train.max3.de").read_text() == "x y z\ny\n"


def test_fetch_passes_apt_absolute_folders_for_a_relative_out(tmp_path, monkeypatch):
    # apt-get resolves a relative Dir::State::Lists under /var/lib/apt, not the working folder
    import pytest

    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return pd.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pd.subprocess, "run", fake_run)
    with pytest.raises(SystemExit, match="could not fetch Debian's Translation-de index"):
        pd.fetch_indexes(pd.Path("rel") / "apt", "de")
    opts = [a for a in seen[0] if a.startswith("Dir::")]
    assert opts == [f"Dir::State::Lists={tmp_path}/rel/apt/lists", f"Dir::Cache={tmp_path}/rel/apt/cache"]
