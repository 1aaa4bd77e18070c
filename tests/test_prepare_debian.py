"""The Debian description corpus builder: parsing, pairing and splitting (no network)."""

import pytest
from conftest import ROOT, load_file

pd = load_file(ROOT / "examples" / "translation" / "prepare_debian.py")

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
    assert paras == ["Foo tools read foo files\nand write bar files.", "This package holds the tools."]
    assert pd.flat(paras[0]) == "Foo tools read foo files and write bar files."


def test_paragraph_items_start_at_list_markers():
    para = "It offers:\n * fast scans\n   of large disks\n - reports\n 2. an applet\nover-long-word - not a list"
    assert pd.paragraph_items(para) == [
        "It offers:", "* fast scans of large disks", "- reports", "2. an applet over-long-word - not a list"]


ALIGN = pd.SentenceAligner("de")


def test_aligner_splits_items_then_sentences_where_counts_agree():
    en = "Brasero burns CDs. It is simple, e.g. for audio. It features:\n * on-the-fly burning\n * multisession"
    de = "Brasero brennt CDs. Es ist einfach, z. B. für Audio. Es kann:\n * On-the-fly-Brennen\n * Multisession"
    assert ALIGN(en, de) == [
        ("Brasero burns CDs.", "Brasero brennt CDs."),
        ("It is simple, e.g. for audio.", "Es ist einfach, z. B. für Audio."),
        ("It features:", "Es kann:"),
        ("* on-the-fly burning", "* On-the-fly-Brennen"),
        ("* multisession", "* Multisession"),
    ]


def test_aligner_keeps_units_whole_when_counts_or_lengths_disagree():
    # 2 English sentences, 3 German ones: the pair stays whole
    en, de = "Hnb is orphaned. Nobody adds features.", "Hnb ist verwaist. Niemand pflegt es. Es gibt keine Funktionen."
    assert ALIGN(en, de) == [(en, de)]
    # same count, but the split is at different places (lengths far off the pair's ratio)
    en, de = "Short one. This sentence is a rather long one with many words in it.", "Dies ist ein ziemlich langer Satz mit vielen Wörtern darin. Kurz."
    assert len(ALIGN.en(en)) == len(ALIGN.xx(de)) == 2
    assert ALIGN(en, de) == [(en, de)]
    # 2 list items against 1: the items are not paired, the sentences still are
    en, de = "Tools:\n * a\n * b", "Werkzeuge: a und b"
    assert ALIGN(en, de) == [("Tools: * a * b", "Werkzeuge: a und b")]


def test_aligner_without_a_sentence_splitter_for_the_language_pairs_items_only():
    ja = pd.SentenceAligner("ja")
    assert ja("One. Two.\n * x", "Ichi. Ni.\n * y") == [("One. Two.", "Ichi. Ni."), ("* x", "* y")]


def test_pairs_by_md5_short_always_long_only_when_paragraphs_match():
    pairs = pd.pair_descriptions(pd.descriptions(EN, "en"), pd.descriptions(DE, "de"))
    assert pairs == [
        ("tools for foo", "Werkzeuge für foo", "foo-utils"),
        ("Foo tools read foo files and write bar files.", "Foo-Werkzeuge lesen foo-Dateien und schreiben bar-Dateien.", "foo-utils"),
        ("This package holds the tools.", "Dieses Paket enthält die Werkzeuge.", "foo-utils"),
        # bbb: 3 English paragraphs against 1 German one: only the short descriptions pair
        ("foo library - development files", "foo-Bibliothek - Entwicklungsdateien", "libfoo-dev"),
    ]


def test_pairs_split_into_sentences_with_an_aligner():
    pairs = pd.pair_descriptions(pd.descriptions(EN.replace("foo files\n and", "foo files.\n They"), "en"),
                                 pd.descriptions(DE.replace("foo-Dateien\n und", "foo-Dateien.\n Sie"), "de"),
                                 ALIGN)
    assert pairs[1:3] == [("Foo tools read foo files.", "Foo-Werkzeuge lesen foo-Dateien.", "foo-utils"),
                          ("They write bar files.", "Sie schreiben bar-Dateien.", "foo-utils")]


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


def test_split_pairs_keeps_a_family_in_one_split():
    pairs = [(f"s{i}", f"t{i}", name) for i, name in enumerate(["libzap-dev", "zap", "zap-doc"] * 20)]
    splits = pd.split_pairs(pairs, 30.0, 30.0)
    assert sorted(map(len, splits.values())) == [0, 0, 60]


def test_held_out_pairs_whose_source_is_in_train_are_dropped():
    fams = [f"fam{i}" for i in range(200)]
    where = {f: pd.split_of(pd.package_family(f), 10.0, 10.0) for f in fams}
    pairs = [(f"{f} text", "t", f) for f in fams] + [("shared line", f"t {f}", f) for f in fams]
    splits = pd.split_pairs(pairs, 10.0, 10.0)
    splits = {k: v if k == "train" else pd.drop_seen(v, splits["train"]) for k, v in splits.items()}
    for split in ("valid", "test"):
        assert sorted(s for s, _ in splits[split]) == sorted(f"{f} text" for f in fams if where[f] == split)
    assert sum(s == "shared line" for s, _ in splits["train"]) == sum(w == "train" for w in where.values())


def test_filter_train_keeps_pairs_short_on_both_sides(tmp_path):
    (tmp_path / "train.en").write_text("a b\na b c d\na\na b c\n")
    (tmp_path / "train.de").write_text("x y z\nx\nx y z w\ny\n")
    prefix, kept, total = pd.filter_train(tmp_path, "de", 3)
    assert (prefix, kept, total) == ("train.max3", 2, 4)
    assert (tmp_path / "train.max3.en").read_text() == "a b\na b c\n"
    assert (tmp_path / "train.max3.de").read_text() == "x y z\ny\n"


def test_fetch_passes_apt_absolute_folders_for_a_relative_out(tmp_path, monkeypatch):
    # apt-get resolves a relative Dir::State::Lists under /var/lib/apt, not the working folder
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


# Hand-written pages in the help's HTML form (not LibreOffice text).
HELP_EN = """<html><body><h1 id="hd_id1" dir="auto">Standard Filter</h1>
<p id="par_id2" class="paragraph"><span class="avis">Sets the <a href="x.html">filter</a>
options.</span></p><p id="par_id3">LibreOffice</p><p id="par_id4">12</p><p>no id</p>
<p id="par_id5">Only in English.</p><p id="par_id2">A repeated id keeps the first text.</p></body></html>"""
HELP_DE = """<html><body><h1 id="hd_id1" dir="auto">Standardfilter</h1>
<p id="par_id2" class="paragraph"><span class="avis">Legt die <a href="x.html">Filter</a>optionen
fest.</span></p><p id="par_id3">LibreOffice</p><p id="par_id4">12</p></body></html>"""


def write_help(root, lang, page, name="text/scalc/f.html"):
    (root / lang / name).parent.mkdir(parents=True, exist_ok=True)
    (root / lang / name).write_text(page)
    return root / lang


def test_help_pages_pair_by_file_and_paragraph_id(tmp_path):
    en = pd.help_paragraphs(write_help(tmp_path, "en-US", HELP_EN))
    de = pd.help_paragraphs(write_help(tmp_path, "de", HELP_DE))
    assert en[("text/scalc/f.html", "par_id2")] == "Sets the filter options."
    # untranslated (LibreOffice) and letterless (12) paragraphs are left out; par_id5 has no German
    assert pd.pair_help(en, de) == [
        ("Standard Filter", "Standardfilter", "text/scalc/f.html"),
        ("Sets the filter options.", "Legt die Filteroptionen fest.", "text/scalc/f.html"),
    ]


def test_a_cached_corpus_built_another_way_is_rebuilt_and_help_becomes_test1(tmp_path, monkeypatch, capsys):
    en = EN.replace("foo files\n and", "foo files.\n They")
    de = DE.replace("foo-Dateien\n und", "foo-Dateien.\n Sie")
    monkeypatch.setattr(pd, "fetch_indexes", lambda apt, lang: (en, de))
    help_root = tmp_path / "help"
    help_dirs = (write_help(help_root, "en-US", HELP_EN), write_help(help_root, "de", HELP_DE))
    monkeypatch.setattr(pd, "fetch_help", lambda apt, lang: help_dirs)
    monkeypatch.setattr(pd, "train_spm", lambda *a: None)

    def encode(raw, spm_dir, model, lang):
        spm_dir.mkdir(parents=True, exist_ok=True)
        (spm_dir / f"test.{lang}").write_text("")

    monkeypatch.setattr(pd, "encode", encode)
    monkeypatch.setattr(pd, "preprocess", lambda *a, **k: None)
    out = tmp_path / "c"
    # test-pct 100: every pair lands in test
    pd.main(["--out", str(out), "--test-pct", "100", "--no-sentences"])
    assert (out / "raw" / "test.en").read_text().count("\n") == 4
    pd.main(["--out", str(out), "--test-pct", "100", "--no-sentences"])
    assert "rebuilding" not in capsys.readouterr().out
    pd.main(["--out", str(out), "--test-pct", "100"])
    assert "was built another way; rebuilding it (sentences)" in capsys.readouterr().out
    assert (out / "raw" / "test.en").read_text().count("\n") == 5
    assert not (out / "raw" / "test-help.en").exists()
    pd.main(["--out", str(out), "--test-pct", "100", "--libreoffice"])
    assert "rebuilding it (sentences libreoffice)" in capsys.readouterr().out
    assert (out / "raw" / "test-help.de").read_text() == "Standardfilter\nLegt die Filteroptionen fest.\n"
    assert (out / "raw" / "RECIPE").read_text() == "sentences libreoffice\n"


def test_preprocess_binarises_help_as_a_second_test_subset(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(pd.subprocess, "run", lambda cmd, **kw: seen.append(cmd))
    (tmp_path / "test.en").write_text("")
    pd.preprocess(tmp_path, tmp_path / "bin", "de")
    (tmp_path / "test-help.en").write_text("")
    pd.preprocess(tmp_path, tmp_path / "bin", "de")
    tests = [cmd[cmd.index("--testpref") + 1] for cmd in seen]
    assert tests == [f"{tmp_path}/test", f"{tmp_path}/test,{tmp_path}/test-help"]


def test_description_test_pairs_seen_in_help_training_files_are_dropped(tmp_path, monkeypatch):
    # help files train, package families test: a help paragraph equal to a description's
    # English text must take that description pair out of test
    help_en = HELP_EN.replace("Only in English.", "This package holds the tools.")
    help_de = HELP_DE.replace("</body>", '<p id="par_id5">Dieses Paket hat die Werkzeuge.</p></body>')
    help_root = tmp_path / "help"
    help_dirs = (write_help(help_root, "en-US", help_en), write_help(help_root, "de", help_de))
    monkeypatch.setattr(pd, "fetch_indexes", lambda apt, lang: (EN, DE))
    monkeypatch.setattr(pd, "fetch_help", lambda apt, lang: help_dirs)
    monkeypatch.setattr(pd, "split_of", lambda g, v, t: "train" if g.startswith("help:") else "test")
    monkeypatch.setattr(pd, "train_spm", lambda *a: (_ for _ in ()).throw(SystemExit("stop")))

    with pytest.raises(SystemExit, match="stop"):
        pd.main(["--out", str(tmp_path / "c"), "--libreoffice"])
    test_en = (tmp_path / "c" / "raw" / "test.en").read_text().splitlines()
    assert "This package holds the tools." not in test_en
    assert test_en[0] == "tools for foo" and len(test_en) == 3
    assert "This package holds the tools." in (tmp_path / "c" / "raw" / "train.en").read_text()
