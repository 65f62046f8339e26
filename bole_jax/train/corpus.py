"""Offline training corpus: Python sources and plain-text documentation found on the machine.

Never the evaluation sets (Spec-Bench, HumanEval, BFCL): files whose path mentions them are skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

TEXT_SUFFIXES = {".py", ".txt", ".rst", ".md"}
EXCLUDE = ("human_eval", "humaneval", "spec_bench", "bfcl")  # evaluation sets: never trained on


def default_roots() -> list[Path]:
    """The Python standard library plus Debian documentation folders when present."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    for d in (
        "/usr/share/doc/python3.11",
        "/usr/share/doc/python3-doc",
        "/usr/share/doc/git-doc",
        "/usr/share/doc/sqlite3-doc",
    ):
        if Path(d).is_dir():
            roots.append(Path(d))
    return roots


def corpus_files(roots: Iterable[Path] | None = None, seed: int = 0) -> list[Path]:
    """All text files under `roots` (sorted, then shuffled with `seed`: deterministic)."""
    files = []
    # The default roots are the standard library (its site-packages varies per machine: skipped);
    # roots given explicitly are taken whole.
    skip = ("/site-packages/",) if not roots else ()
    for root in list(roots) if roots else default_roots():
        root = Path(root)
        if root.is_file():
            files.append(root)
            continue
        for p in sorted(root.rglob("*")):
            s = str(p).lower()
            if (
                p.is_file()
                and p.suffix in TEXT_SUFFIXES
                and not any(x in s for x in EXCLUDE + skip)
            ):
                files.append(p)
    random.Random(seed).shuffle(files)
    return files


def iter_documents(files: Iterable[Path], max_bytes: int | None = None) -> Iterator[str]:
    """Yield file contents (UTF-8, undecodable files skipped) up to max_bytes in total."""
    total = 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        yield text
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            return


# ----------------------------------------------------------------------------- the training recipe

DOC_DIRS = ("/usr/share/doc",)
SKIP_DIR_PARTS = ("__pycache__", "node_modules", ".git")
SKIP_DIR_SUFFIXES = (".dist-info", ".egg-info")
# Boilerplate repeated in nearly every package (licences) and packaging metadata.
SKIP_NAME_PREFIXES = (
    "license",
    "licence",
    "copying",
    "notice",
    "authors",
    "record",
    "entry_points",
    "top_level",
    "dependency_links",
    "installer",
    "requested",
    "wheel",
)


def machine_roots() -> list[Path]:
    """Every folder of Python sources and docs this machine has, resolved and de-duplicated:
    the running interpreter's stdlib and site-packages, every /usr/lib, /usr/local/lib and
    /opt/*/.venv Python, and /usr/share/doc. Which of them exist depends on the machine; file
    contents are de-duplicated afterwards, so overlapping roots cost nothing."""
    import glob
    import site

    cands = [sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")]
    cands += list(getattr(site, "getsitepackages", lambda: [])())
    for pattern in (
        "/usr/lib/python3*",
        "/usr/local/lib/python3*",
        "/opt/*/.venv/lib/python3*",
        "/opt/*/lib/python3*",
        "/usr/share/doc",
    ):
        cands += sorted(glob.glob(pattern))
    out, seen = [], set()
    for c in cands:
        p = Path(c)
        if not p.is_dir():
            continue
        r = p.resolve()
        if r not in seen:
            seen.add(r)
            out.append(r)
    # A root inside another root would be walked twice: keep the outer one.
    return [r for r in out if not any(o != r and o in r.parents for o in out)]


def _walk(root: Path) -> Iterator[tuple[str, Path]]:
    """(path relative to root, path) of the candidate text files under root, in sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIR_PARTS and not d.endswith(SKIP_DIR_SUFFIXES)
        )
        for name in sorted(filenames):
            low = name.lower()
            if os.path.splitext(low)[1] not in RECIPE_SUFFIXES or low.startswith(
                SKIP_NAME_PREFIXES
            ):
                continue
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if any(x in str(p).lower() for x in EXCLUDE):
                continue
            yield rel, p


RECIPE_SUFFIXES = (".py", ".pyi", ".rst", ".md", ".txt")


def _keep_text(text: str, max_line: int) -> str | None:
    """The reason a file's text is rejected ("empty", "long-lines", "word-list", "numeric"), or
    None to keep. Long lines mark minified or generated files, many very short lines word lists
    (tokenizer vocabularies, dictionaries), mostly digits data tables."""
    if not text.strip():
        return "empty"
    lines = text.count("\n") + 1
    if max(map(len, text.split("\n"))) > max_line or len(text) / lines > max_line / 10:
        return "long-lines"
    if lines > 1000 and len(text) / lines < 10:
        return "word-list"
    digits = sum(text.count(d) for d in "0123456789")
    if digits > 0.3 * len(text):
        return "numeric"
    return None


@dataclasses.dataclass
class Corpus:
    """Documents of the recipe, split by content hash. `stats` counts files and bytes."""

    train: list[str]
    val: list[str]
    stats: dict


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def collect_corpus(
    roots: Iterable[Path] | None = None,
    *,
    max_bytes: int = 300_000_000,
    max_val_bytes: int = 3_000_000,
    val_per_mille: int = 10,
    max_file_bytes: int = 256_000,
    min_file_bytes: int = 64,
    max_line: int = 1000,
    workers: int = 16,
) -> Corpus:
    """Deterministic document selection for training (independent of walk order and timing).

    Candidate files (suffixes RECIPE_SUFFIXES, no packaging metadata or licences, no evaluation
    set, min_file_bytes..max_file_bytes) are visited in the order of a hash of (path relative to
    its root), a machine-independent shuffle, and read until `max_bytes` of training text; each
    file is kept once per distinct content (exact dedup by a 64-bit content hash) and goes to
    validation when content_hash % 1000 < val_per_mille (so copies of one file never straddle
    the split), until max_val_bytes. Bytes count UTF-8 characters of the kept text.
    """
    from concurrent.futures import ThreadPoolExecutor

    roots = [Path(r) for r in roots] if roots else machine_roots()
    cands = []
    for root in roots:
        if root.is_file():
            cands.append((root.name, root))
        elif root.is_dir():
            cands.extend(_walk(root))
    order = sorted(cands, key=lambda rp: (_digest(rp[0].encode()), rp[0], str(rp[1])))
    stats = dict(
        roots=[str(r) for r in roots],
        candidates=len(order),
        read=0,
        kept_train=0,
        kept_val=0,
        train_chars=0,
        val_chars=0,
        duplicate=0,
        too_small=0,
        too_big=0,
        undecodable=0,
        empty=0,
        long_lines=0,
        word_list=0,
        numeric=0,
        suffix_chars={},
    )
    train, val, seen = [], [], set()

    def read(rp):
        try:
            size = rp[1].stat().st_size
            if size < min_file_bytes or size > max_file_bytes:
                return rp, ("too_small" if size < min_file_bytes else "too_big"), None
            return rp, None, rp[1].read_bytes()
        except OSError:
            return rp, "undecodable", None

    chunk = 4096
    with ThreadPoolExecutor(workers) as ex:
        for i in range(0, len(order), chunk):
            for (rel, path), why, data in ex.map(read, order[i : i + chunk]):
                if stats["train_chars"] >= max_bytes:
                    break
                if why:
                    stats[why] += 1
                    continue
                stats["read"] += 1
                h = _digest(data)
                if h in seen:
                    stats["duplicate"] += 1
                    continue
                seen.add(h)
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    stats["undecodable"] += 1
                    continue
                why = _keep_text(text, max_line)
                if why:
                    stats[why.replace("-", "_")] += 1
                    continue
                if h % 1000 < val_per_mille:
                    if stats["val_chars"] >= max_val_bytes:
                        continue
                    val.append(text)
                    stats["kept_val"] += 1
                    stats["val_chars"] += len(text)
                else:
                    train.append(text)
                    stats["kept_train"] += 1
                    stats["train_chars"] += len(text)
                    suf = os.path.splitext(rel)[1]
                    stats["suffix_chars"][suf] = stats["suffix_chars"].get(suf, 0) + len(text)
            else:
                continue
            break
    return Corpus(train=train, val=val, stats=stats)
