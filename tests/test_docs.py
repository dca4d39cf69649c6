"""Citations of the maths reference: every "§N" in the repository names a section of docs/MATH.md.

* No file of the repository cites the starting specification (a file that is not in the
  repository); the maths is docs/MATH.md.
* Every section reference in a text file of the repository, "docs/MATH.md §3.4", a bare "§3.4", a
  range "§6.3-6.6" or "§2.4–§2.6", or "§9 item 16" / "§9 identities 1, 3" (the numbered oracles
  §9.1-§9.19), exists as a heading of docs/MATH.md.
* docs/MATH.md's section numbers are unique.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MATH = ROOT / "docs" / "MATH.md"
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".txt", ".cfg", ".toml", ".sh", ".yaml", ".yml"}
# Written split so this file does not cite it itself.
_OLD_SPEC = re.compile(r"\b" + "SP" + r"EC(?:\.md\b|\s*§)")
_NUMBER = r"\d+(?:\.\d+)*"
_HEADING = re.compile(rf"^#{{1,6}}\s+({_NUMBER})\.?\s")
# "§N", optionally a range "-N" / "–§N", optionally "item(s)/identity(ies) a, b-c and d".
_REFERENCE = re.compile(
    rf"§\s?(?P<first>{_NUMBER})"
    rf"(?:\s?[-–]\s?§?(?P<last>{_NUMBER}))?"
    rf"(?:,?\s+(?:items?|identit(?:y|ies))\s+(?P<items>\d+(?:\s*(?:,|-|–|and)\s*\d+)*))?")


def tracked_text_files() -> list[pathlib.Path]:
  """The repository's text files: tracked or not ignored (`git ls-files`; a plain walk outside a
  git checkout)."""
  try:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    paths = [ROOT / line for line in out.stdout.splitlines()]
  except (OSError, subprocess.CalledProcessError):
    skip = {".git", ".venv", "runs", "build", "dist", "__pycache__", ".ipynb_checkpoints"}
    paths = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
      dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
      paths += [pathlib.Path(dirpath) / name for name in filenames]
  return sorted(p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file())


def math_sections(text: str) -> list[str]:
  """Section numbers of the Markdown headings ("## 3. ...", "### 3.4 ...") in order."""
  return [m.group(1) for line in text.splitlines() if (m := _HEADING.match(line))]


def cited_sections(text: str) -> list[str]:
  """Every section number a text refers to with §, ranges and §9's oracle items expanded (items
  of other sections, such as "§3.8 item 4", are list items, not headings)."""
  cited = []
  for m in _REFERENCE.finditer(text):
    cited.append(m.group("first"))
    if m.group("last"):
      cited.append(m.group("last"))
    if m.group("items") and m.group("first") == "9":
      cited += [f"{m.group('first')}.{n}" for n in re.findall(r"\d+", m.group("items"))]
  return cited


FILES = tracked_text_files()


def test_the_tree_is_scanned():
  names = {str(p.relative_to(ROOT)) for p in FILES}
  assert {"README.md", "docs/MATH.md", "lineax_attn/ops/chunked.py"} <= names


def test_no_file_cites_the_old_spec():
  hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
          for p in FILES
          for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
          if _OLD_SPEC.search(line)]
  assert not hits, "cite docs/MATH.md instead:\n" + "\n".join(hits)


def test_math_section_numbers_are_unique_and_cover_the_oracles():
  sections = math_sections(MATH.read_text(encoding="utf-8"))
  duplicates = sorted({s for s in sections if sections.count(s) > 1})
  assert not duplicates, f"docs/MATH.md repeats sections {duplicates}"
  assert [f"9.{i}" for i in range(1, 20)] == [s for s in sections if s.startswith("9.")]


def test_every_cited_section_exists():
  sections = set(math_sections(MATH.read_text(encoding="utf-8")))
  missing = []
  for p in FILES:
    for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
      missing += [f"{p.relative_to(ROOT)}:{n}: §{s}" for s in cited_sections(line)
                  if s not in sections]
  assert not missing, "no such section in docs/MATH.md:\n" + "\n".join(missing)


@pytest.mark.parametrize("text,expected", [
    ("docs/MATH.md §3.4 rule 3", ["3.4"]),
    ("(docs/MATH.md §2.0, §3.2)", ["2.0", "3.2"]),
    ("§6.3-6.6 and §2.4–§2.6", ["6.3", "6.6", "2.4", "2.6"]),
    ("§9 item 16; §9, items 6-8; §9 identities 1, 3 and 5", ["9", "9.16", "9", "9.6", "9.8", "9",
                                                            "9.1", "9.3", "9.5"]),
    ("§9.18, §9 (unit q/k), §3.8 item 4", ["9.18", "9", "3.8"]),
    ("no reference, a § alone, 2.4", []),
])
def test_reference_parser(text, expected):
  assert cited_sections(text) == expected


def test_headings_parser_and_a_missing_section_is_reported():
  text = "# The maths\n## 1. Notation\n### 1.7 Segments\nbody §1.7\n#### 9.18 Softmax\n"
  assert math_sections(text) == ["1", "1.7", "9.18"]
  missing = [s for s in cited_sections("see \u00a7" + "99.1") if s not in math_sections(text)]
  assert missing == ["99.1"]
