#!/usr/bin/env python
"""Build a real English->X translation corpus offline from Debian's archive (DDTP).

Debian's translated package descriptions (the Debian Description Translation
Project) are human translations that apt fetches as index files. This script:

1. runs ``apt-get update`` with a private state folder (the system's apt state
   is untouched) and ``Acquire::Languages=en,<lang>``, using the sources the
   machine already has;
2. pairs the English and <lang> stanzas by ``Description-md5``: the short
   descriptions, and the long descriptions paragraph by paragraph where both
   have the same number of paragraphs; splits a paragraph pair further into list
   items and sentences where both sides have the same number of them (off with
   ``--no-sentences``); deduplicates;
3. splits train/valid/test by package family (a normalised name prefix,
   hashed), never by line, so formulaic descriptions of one family do not leak
   from train into test, and drops held-out pairs whose English text also occurs
   in train; the split is deterministic;
4. trains a joint sentencepiece model on the training pairs, encodes every
   split, and runs ``fairseq-preprocess`` with a joined dictionary.

    python examples/translation/prepare_debian.py --lang de --out data/debian-ende

``--libreoffice`` adds LibreOffice's help pages (MPL-2.0), a second corpus aligned
exactly by paragraph id: its training files join train, its held-out files become
the ``test1`` subset. ``--max-train-tokens N`` keeps only the training pairs of at
most N sentencepiece tokens on both sides (valid and test stay whole) and writes
``bin-max<N>`` beside ``bin``: on a CPU, short pairs teach the model faster.

Each step is skipped when its output exists (delete the folder to rebuild).
The descriptions are archive metadata without an explicit license: the data is
fetched at run time and not committed. A rebuild with other segmenting or sources
replaces the cached folder's data.
"""

import argparse
import hashlib
import random
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Tuple

LANGS = ("de", "fr", "it", "es", "da", "nl", "pt", "ru", "ja", "pl", "sv", "fi", "cs", "uk")
APT_HELPER = "/usr/lib/apt/apt-helper"


# ----------------------------------------------------------------------------- parsing
def parse_stanzas(text: str) -> Iterator[Dict[str, str]]:
    """RFC-822 stanzas: ``{"Package", "Description-md5", "Description-xx": full text}``."""
    for block in text.split("\n\n"):
        fields: Dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if line.startswith((" ", "\t")) and key:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields:
            yield fields


def split_description(desc: str) -> Tuple[str, List[str]]:
    """(short description, long-description paragraphs); ' .' lines separate paragraphs.

    A paragraph keeps its line breaks: a line starting with a list marker begins a list item
    (see ``paragraph_items``); ``flat`` joins the lines.
    """
    lines = desc.split("\n")
    short = lines[0].strip()
    paragraphs, cur = [], []
    for line in lines[1:]:
        body = line[1:] if line.startswith(" ") else line
        if body.strip() == ".":
            if cur:
                paragraphs.append("\n".join(cur))
            cur = []
        elif body.strip():
            cur.append(body.rstrip())
    if cur:
        paragraphs.append("\n".join(cur))
    return short, paragraphs


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


LIST_MARKER = re.compile(r"^\s*([*+\-o\u2022]|\d+[.)])\s+")


def paragraph_items(paragraph: str) -> List[str]:
    """The paragraph's list items: a new item starts at each line that begins with a list
    marker (``*``, ``-``, ``+``, ``o``, a bullet, ``1.``); the text before the first one is an
    item too."""
    items: List[List[str]] = []
    for line in paragraph.split("\n"):
        if not items or LIST_MARKER.match(line):
            items.append([])
        items[-1].append(line)
    return [flat(" ".join(i)) for i in items if flat(" ".join(i))]


class SentenceAligner:
    """Splits an aligned pair of paragraphs into aligned sentence pairs where that is safe.

    Translators of package descriptions keep the paragraphs and almost always the list items
    and sentences of the English text. A paragraph pair is split into its list items when both
    sides have the same number of items, and an item pair into sentences (Moses-style
    splitting with each language's non-breaking prefixes, from the ``sentence-splitter``
    package) when both have the same number of sentences and every sentence pair's length
    ratio is within a factor ``max_ratio`` of the whole pair's; otherwise the unit stays whole.
    Languages the splitter does not know are split into list items only.
    """

    def __init__(self, lang: str, max_ratio: float = 2.5):
        from sentence_splitter import SentenceSplitter, SentenceSplitterException

        def splitter(code):
            try:
                return SentenceSplitter(language=code).split
            except SentenceSplitterException:
                return None

        self.en, self.xx = splitter("en"), splitter(lang)
        self.max_ratio = max_ratio

    def _ratio_ok(self, a: List[str], b: List[str]) -> bool:
        whole = max(1, sum(map(len, b))) / max(1, sum(map(len, a)))
        for x, y in zip(a, b):
            r = max(1, len(y)) / max(1, len(x)) / whole
            if not 1 / self.max_ratio <= r <= self.max_ratio:
                return False
        return True

    def _sentences(self, s: str, t: str) -> List[Tuple[str, str]]:
        if self.en and self.xx:
            a, b = self.en(s), self.xx(t)
            if 1 < len(a) == len(b) and self._ratio_ok(a, b):
                return list(zip(a, b))
        return [(s, t)]

    def __call__(self, en_paragraph: str, xx_paragraph: str) -> List[Tuple[str, str]]:
        a, b = paragraph_items(en_paragraph), paragraph_items(xx_paragraph)
        if len(a) != len(b) or not self._ratio_ok(a, b):
            a, b = [flat(en_paragraph)], [flat(xx_paragraph)]
        return [p for x, y in zip(a, b) for p in self._sentences(x, y)]


def descriptions(text: str, lang: str) -> Dict[str, Tuple[str, str]]:
    """{Description-md5: (package, description)} for one language's index."""
    out = {}
    for st in parse_stanzas(text):
        md5, desc = st.get("Description-md5"), st.get(f"Description-{lang}")
        if md5 and desc:
            out[md5] = (st.get("Package", ""), desc)
    return out


def pair_descriptions(en: Dict[str, Tuple[str, str]], xx: Dict[str, Tuple[str, str]],
                      align=None) -> List[Tuple[str, str, str]]:
    """(english, translation, package) pairs, deduplicated, in a stable order.

    ``align(en_paragraph, xx_paragraph)`` -> sentence pairs (a ``SentenceAligner``); without
    it each paragraph is one pair.
    """
    align = align or (lambda s, t: [(flat(s), flat(t))])
    pairs, seen = [], set()
    for md5 in sorted(set(en) & set(xx)):
        pkg, en_desc = en[md5]
        _, xx_desc = xx[md5]
        en_short, en_long = split_description(en_desc)
        xx_short, xx_long = split_description(xx_desc)
        cands = [(en_short, xx_short)]
        if len(en_long) == len(xx_long):
            cands += [p for s, t in zip(en_long, xx_long) for p in align(s, t)]
        for s, t in cands:
            if s and t and (s, t) not in seen and "\t" not in s + t:
                seen.add((s, t))
                pairs.append((s, t, pkg))
    return pairs


HELP_ID = re.compile(r"^(par|hd)_id\d+")


class _HelpParagraphs(HTMLParser):
    """Text of the elements whose id is a LibreOffice help paragraph id (``par_id…``, ``hd_id…``)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: Dict[str, str] = {}
        self._cur = None  # [tag, nesting depth of that tag, id, text parts]

    def handle_starttag(self, tag, attrs):
        if self._cur is None:
            ident = dict(attrs).get("id") or ""
            if HELP_ID.match(ident):
                self._cur = [tag, 0, ident, []]
        elif tag == self._cur[0]:
            self._cur[1] += 1

    def handle_endtag(self, tag):
        if self._cur is not None and tag == self._cur[0]:
            if self._cur[1] == 0:
                self.found.setdefault(self._cur[2], flat("".join(self._cur[3])))
                self._cur = None
            else:
                self._cur[1] -= 1

    def handle_data(self, data):
        if self._cur is not None:
            self._cur[3].append(data)


def help_paragraphs(root: Path) -> Dict[Tuple[str, str], str]:
    """{(help file relative to root, paragraph id): text} for one language's help pages."""
    out = {}
    for f in sorted(root.rglob("*.html")):
        parser = _HelpParagraphs()
        parser.feed(f.read_text(errors="replace"))
        rel = f.relative_to(root).as_posix()
        out.update({(rel, ident): text for ident, text in parser.found.items()})
    return out


def pair_help(en: Dict[Tuple[str, str], str], xx: Dict[Tuple[str, str], str]) -> List[Tuple[str, str, str]]:
    """(english, translation, help file) pairs by (file, id), deduplicated; untranslated
    paragraphs (the same text on both sides) and ones without a letter are left out."""
    pairs, seen = [], set()
    for key in sorted(set(en) & set(xx)):
        s, t = en[key], xx[key]
        if s and t and s != t and re.search(r"[^\W\d_]", s) and (s, t) not in seen and "\t" not in s + t:
            seen.add((s, t))
            pairs.append((s, t, key[0]))
    return pairs


def package_family(pkg: str) -> str:
    """Normalised name prefix: 'libfoo-dev', 'foo-doc', 'python3-foo' -> 'foo'."""
    name = re.sub(r"^(lib|python3?-|ruby-|node-|golang-|r-cran-|php-|perl-|lib)", "", pkg.lower())
    name = re.sub(r"[-.]?(dev|doc|dbg|data|common|utils?|tools|bin|dbgsym|\d+(\.\d+)*)$", "", name)
    name = re.split(r"[-.+]", name)[0] or pkg
    return re.sub(r"\d+$", "", name) or name


def split_of(group: str, valid_pct: float, test_pct: float) -> str:
    """Deterministic split from a hash of the group."""
    h = int(hashlib.sha1(group.encode()).hexdigest()[:8], 16) % 10000 / 100.0
    if h < test_pct:
        return "test"
    if h < test_pct + valid_pct:
        return "valid"
    return "train"


# ------------------------------------------------------------------------------ steps
def apt_get(apt_dir: Path, *args: str) -> List[str]:
    """An apt-get command on the private lists and cache under apt_dir (an absolute path: apt
    reads a relative Dir::State::Lists under its own Dir::State, /var/lib/apt, so a relative
    --out would write into the system's apt folder and find nothing here)."""
    return ["apt-get", "-q", "-o", f"Dir::State::Lists={apt_dir / 'lists'}", "-o",
            f"Dir::Cache={apt_dir / 'cache'}", *args]


def fetch_indexes(apt_dir: Path, lang: str) -> Tuple[str, str]:
    """apt-get update into apt_dir; returns the English and <lang> index texts."""
    apt_dir = apt_dir.resolve()
    lists = apt_dir / "lists"
    if not list(lists.glob(f"*_i18n_Translation-{lang}*")):
        (lists / "partial").mkdir(parents=True, exist_ok=True)
        (apt_dir / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        cmd = apt_get(apt_dir, "-o", f"Acquire::Languages=en,{lang}", "update")
        print("    " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not list(lists.glob(f"*_i18n_Translation-{lang}*")):
            shutil.rmtree(lists, ignore_errors=True)
            raise SystemExit(
                f"apt-get update could not fetch Debian's Translation-{lang} index "
                f"(exit {proc.returncode}); is the archive reachable from this machine?\n"
                f"{proc.stderr[-1500:]}")

    def read(pattern):
        texts = []
        for f in sorted(lists.glob(pattern)):
            if f.name.endswith((".lz4", ".gz", ".xz", ".bz2", ".zst")) and Path(APT_HELPER).exists():
                texts.append(subprocess.run([APT_HELPER, "cat-file", str(f)], capture_output=True,
                                            text=True, check=True).stdout)
            else:
                texts.append(f.read_text(errors="replace"))
        return "\n\n".join(texts)

    return read("*_i18n_Translation-en*"), read(f"*_i18n_Translation-{lang}*")


def fetch_help(apt_dir: Path, lang: str) -> Tuple[Path, Path]:
    """``apt-get download`` the English and <lang> LibreOffice help packages (with the private
    lists of ``fetch_indexes``) and unpack them; returns the two languages' help folders."""
    apt_dir = apt_dir.resolve()
    root = apt_dir / "libreoffice"
    help_dir = root / "usr" / "share" / "libreoffice" / "help"
    en, xx = help_dir / "en-US", help_dir / lang
    if en.is_dir() and xx.is_dir():
        return en, xx
    debs = apt_dir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    pkgs = ["libreoffice-help-en-us", f"libreoffice-help-{lang}"]
    cmd = apt_get(apt_dir, "download", *pkgs)
    print("    " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=debs)
    if proc.returncode != 0:
        raise SystemExit(f"apt-get download could not fetch {' and '.join(pkgs)} (exit {proc.returncode}); "
                         f"is the archive reachable, and does Debian ship LibreOffice help in '{lang}'?\n"
                         f"{proc.stderr[-1500:]}")
    for pkg in pkgs:
        deb = next(debs.glob(f"{pkg}_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    if not (en.is_dir() and xx.is_dir()):
        raise SystemExit(f"the LibreOffice help packages hold no {en} and {xx}")
    return en, xx


def split_pairs(pairs, valid_pct: float, test_pct: float, group=package_family) -> Dict[str, List[Tuple[str, str]]]:
    """{"train", "valid", "test": [(english, translation)]} split by ``group(third field)``, so
    that one package family (or help file) lands in one split."""
    buckets: Dict[str, List[Tuple[str, str]]] = {"train": [], "valid": [], "test": []}
    for s, t, key in pairs:
        buckets[split_of(group(key), valid_pct, test_pct)].append((s, t))
    return buckets


def drop_seen(held_out: List[Tuple[str, str]], train: List[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """The held-out pairs whose English text does not occur in train (formulaic lines recur
    across package families and help files)."""
    seen = {s for s, _ in train}
    return [(s, t) for s, t in held_out if s not in seen]


def write_pairs(rows: List[Tuple[str, str]], raw: Path, name: str, lang: str) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{name}.en").write_text("".join(s + "\n" for s, _ in rows))
    (raw / f"{name}.{lang}").write_text("".join(t + "\n" for _, t in rows))


def train_spm(raw: Path, spm_dir: Path, lang: str, vocab: int) -> Path:
    import sentencepiece as spm

    model = spm_dir / "spm.model"
    if model.exists():
        return model
    spm_dir.mkdir(parents=True, exist_ok=True)
    joint = spm_dir / "train.joint.txt"
    joint.write_text((raw / "train.en").read_text() + (raw / f"train.{lang}").read_text())
    spm.SentencePieceTrainer.train(
        input=str(joint), model_prefix=str(spm_dir / "spm"), vocab_size=vocab, model_type="unigram",
        character_coverage=1.0, input_sentence_size=2_000_000, shuffle_input_sentence=True,
        bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0, num_threads=2, minloglevel=2)
    joint.unlink()
    return model


def encode(raw: Path, spm_dir: Path, model: Path, lang: str) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    for split in ("train", "valid", "test", "test-help"):
        if not (raw / f"{split}.en").exists():
            continue
        for side in ("en", lang):
            lines = (raw / f"{split}.{side}").read_text().splitlines()
            out = spm_dir / f"{split}.{side}"
            out.write_text("".join(" ".join(sp.encode(l, out_type=str)) + "\n" for l in lines))


def filter_train(spm_dir: Path, lang: str, max_tokens: int) -> Tuple[str, int, int]:
    """Write ``train.max<N>.{en,lang}``: the pairs with <= N tokens on both sides."""
    prefix = f"train.max{max_tokens}"
    src = (spm_dir / "train.en").read_text().splitlines()
    tgt = (spm_dir / f"train.{lang}").read_text().splitlines()
    keep = [(s, t) for s, t in zip(src, tgt) if len(s.split()) <= max_tokens and len(t.split()) <= max_tokens]
    (spm_dir / f"{prefix}.en").write_text("".join(s + "\n" for s, _ in keep))
    (spm_dir / f"{prefix}.{lang}").write_text("".join(t + "\n" for _, t in keep))
    return prefix, len(keep), len(src)


def preprocess(spm_dir: Path, bin_dir: Path, lang: str, train: str = "train") -> None:
    """Binarise; with LibreOffice help its held-out pairs become the ``test1`` subset."""
    tests = [str(spm_dir / t) for t in ("test", "test-help") if (spm_dir / f"{t}.en").exists()]
    cmd = [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "en", "--target-lang", lang,
           "--trainpref", str(spm_dir / train), "--validpref", str(spm_dir / "valid"),
           "--testpref", ",".join(tests), "--destdir", str(bin_dir), "--joined-dictionary",
           "--workers", "2"]
    print("    fairseq-preprocess ... --destdir " + str(bin_dir), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main(argv: Iterable[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--lang", default="de", choices=LANGS, help="target language")
    ap.add_argument("--out", type=Path, help="output folder (default data/debian-en<lang>)")
    ap.add_argument("--vocab", type=int, default=8000, help="joint sentencepiece vocabulary")
    ap.add_argument("--valid-pct", type=float, default=2.0, help="%% of package families for valid")
    ap.add_argument("--test-pct", type=float, default=3.0, help="%% of package families for test")
    ap.add_argument("--max-train-tokens", type=int, default=0,
                    help="also write bin-max<N>: training pairs of <= N tokens per side (0 = off)")
    ap.add_argument("--no-sentences", dest="sentences", action="store_false",
                    help="keep each long-description paragraph as one segment (default: split "
                         "aligned paragraphs into list items and sentences where both sides agree)")
    ap.add_argument("--libreoffice", action="store_true",
                    help="add LibreOffice's help pages (MPL-2.0, aligned by paragraph id): their "
                         "training pairs join train, their held-out files become the test1 subset")
    a = ap.parse_args(argv)
    if a.max_train_tokens < 0:
        ap.error(f"--max-train-tokens must be >= 0 (0 = off), got {a.max_train_tokens}")
    out = a.out or Path("data") / f"debian-en{a.lang}"
    raw, spm_dir, bin_dir = out / "raw", out / "spm", out / "bin"
    recipe = ("sentences" if a.sentences else "paragraphs") + (" libreoffice" if a.libreoffice else "")
    stamp = raw / "RECIPE"
    if (raw / "test.en").exists() and (not stamp.exists() or stamp.read_text().strip() != recipe):
        print(f"=== {out} was built another way; rebuilding it ({recipe})", flush=True)
        for old in [raw, spm_dir, *out.glob("bin*")]:
            shutil.rmtree(old, ignore_errors=True)
    if not (raw / "test.en").exists():
        print(f"=== [1/4] fetching Debian's English and {a.lang} description indexes", flush=True)
        en_text, xx_text = fetch_indexes(out / "apt", a.lang)
        print("=== [2/4] pairing descriptions and splitting by package family", flush=True)
        align = SentenceAligner(a.lang) if a.sentences else None
        pairs = pair_descriptions(descriptions(en_text, "en"), descriptions(xx_text, a.lang), align)
        if not pairs:
            raise SystemExit(f"no en-{a.lang} description pairs found in the fetched indexes")
        splits = split_pairs(pairs, a.valid_pct, a.test_pct)
        if a.libreoffice:
            print(f"    LibreOffice help, English and {a.lang}", flush=True)
            en_help, xx_help = fetch_help(out / "apt", a.lang)
            help_pairs = pair_help(help_paragraphs(en_help), help_paragraphs(xx_help))
            # no valid split: validation stays on the descriptions
            hs = split_pairs(help_pairs, 0.0, a.test_pct, group=lambda f: "help:" + f)
            splits["train"] += hs["train"]
            splits["test-help"] = hs["test"]
        random.Random(1).shuffle(splits["train"])
        for name in splits:
            if name != "train":  # against the whole training set, both corpora
                splits[name] = drop_seen(splits[name], splits["train"])
        print("    " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()), flush=True)
        for name, rows in splits.items():
            write_pairs(rows, raw, name, a.lang)
        stamp.write_text(recipe + "\n")
    if not (spm_dir / f"test.{a.lang}").exists():
        print(f"=== [3/4] joint sentencepiece model ({a.vocab} pieces) and encoding", flush=True)
        model = train_spm(raw, spm_dir, a.lang, a.vocab)
        encode(raw, spm_dir, model, a.lang)
    if not (bin_dir / f"test.en-{a.lang}.{a.lang}.bin").exists():
        print("=== [4/4] binarising", flush=True)
        preprocess(spm_dir, bin_dir, a.lang)
    if a.max_train_tokens:
        bin_dir = out / f"bin-max{a.max_train_tokens}"
        if not (bin_dir / f"test.en-{a.lang}.{a.lang}.bin").exists():
            prefix, kept, total = filter_train(spm_dir, a.lang, a.max_train_tokens)
            print(f"=== training pairs of <= {a.max_train_tokens} tokens per side: {kept} of {total}",
                  flush=True)
            preprocess(spm_dir, bin_dir, a.lang, train=prefix)
    print(f"data-bin: {bin_dir}")


if __name__ == "__main__":
    main()
