"""Offline training corpus: Python sources and plain-text documentation found on the machine.

Never the evaluation sets (Spec-Bench, HumanEval, BFCL): files whose path mentions them are skipped.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

TEXT_SUFFIXES = {".py", ".txt", ".rst", ".md"}
EXCLUDE = ("human_eval", "humaneval", "spec_bench", "bfcl")  # evaluation sets: never trained on


def default_roots() -> list[Path]:
  """The Python standard library plus Debian documentation folders when present."""
  roots = [Path(sysconfig.get_paths()["stdlib"])]
  for d in ("/usr/share/doc/python3.11", "/usr/share/doc/python3-doc", "/usr/share/doc/git-doc",
            "/usr/share/doc/sqlite3-doc"):
    if Path(d).is_dir():
      roots.append(Path(d))
  return roots


def corpus_files(roots: Iterable[Path] | None = None, seed: int = 0) -> list[Path]:
  """All text files under `roots` (sorted, then shuffled with `seed`: deterministic)."""
  files = []
  # The default roots are the standard library (its site-packages varies per machine: skipped);
  # roots given explicitly are taken whole.
  skip = ("/site-packages/",) if not roots else ()
  for root in (list(roots) if roots else default_roots()):
    root = Path(root)
    if root.is_file():
      files.append(root)
      continue
    for p in sorted(root.rglob("*")):
      s = str(p).lower()
      if p.is_file() and p.suffix in TEXT_SUFFIXES and not any(x in s for x in EXCLUDE + skip):
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
