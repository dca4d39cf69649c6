"""The Python snippets of the documentation run as printed, on CPU.

Every fenced ```python block of README.md runs on its own, in a fresh namespace: a reader can
copy any one of them alone. The blocks of docs/*.md build on each other (a page defines a model
and later blocks use it), so each page's blocks run in order in one namespace per page;
docs/LAYERS.md's is marked slow (about 40 s of CPU; run it with `-m slow`).
Code is compiled with the Markdown file as its file name and its real line numbers, so a
traceback points at the line of the page that failed.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_FENCE_OPEN = re.compile(r"^```python\s*$")
_FENCE_CLOSE = re.compile(r"^```\s*$")


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line number of the block's first code line, code) for every ```python block of `path`."""
  blocks, start, lines = [], None, []
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
    if start is None:
      if _FENCE_OPEN.match(line):
        start, lines = number + 1, []
    elif _FENCE_CLOSE.match(line):
      blocks.append((start, "\n".join(lines) + "\n"))
      start = None
    else:
      lines.append(line)
  if start is not None:
    raise ValueError(f"{path.name}: the ```python block opened at line {start - 1} is never "
                     f"closed.")
  return blocks


def run_block(path: pathlib.Path, line: int, code: str, namespace: dict) -> None:
  """Executes `code` as lines `line`.. of `path`; a failure names the page and the line."""
  name = str(path.relative_to(ROOT))
  compiled = compile("\n" * (line - 1) + code, name, "exec")
  try:
    exec(compiled, namespace)  # pylint: disable=exec-used
  except Exception as e:  # pylint: disable=broad-except
    raise AssertionError(f"the ```python block of {name} starting at line {line} failed: "
                         f"{type(e).__name__}: {e}") from e


README = ROOT / "README.md"
README_BLOCKS = python_blocks(README)
DOC_PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if python_blocks(p))


def test_readme_has_python_blocks():
  assert len(README_BLOCKS) >= 2, "README.md lost its usage snippets"


@pytest.mark.parametrize("line,code", README_BLOCKS,
                         ids=[f"README.md:{n}" for n, _ in README_BLOCKS])
def test_readme_block_runs_alone(line, code):
  run_block(README, line, code, {"__name__": "readme_snippet"})


# docs/LAYERS.md takes ~40 s of CPU (a training step, generate, decoding): slow. The other pages
# run in every `make test` (OP_CONTRACT.md ~4 s): a slow-only page had rotted unseen.
_SLOW_PAGES = {"LAYERS.md"}


@pytest.mark.parametrize("page", [
    pytest.param(p, marks=pytest.mark.slow) if p.name in _SLOW_PAGES else p for p in DOC_PAGES],
    ids=[p.name for p in DOC_PAGES])
def test_doc_page_blocks_run_in_order(page):
  namespace = {"__name__": "doc_snippet"}
  for line, code in python_blocks(page):
    run_block(page, line, code, namespace)


def test_block_extraction_and_line_numbers(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("text\n```python\nx = 1\n```\n\n```\nnot python\n```\n"
                  "```python\ny = 2\nz = 3\n```\n")
  assert python_blocks(page) == [(3, "x = 1\n"), (10, "y = 2\nz = 3\n")]
  page.write_text("```python\nx = 1\n")
  with pytest.raises(ValueError, match="line 1 is never closed"):
    python_blocks(page)


def test_a_failing_block_reports_its_line():
  expected = "README.md starting at line 7 failed: NameError"
  with pytest.raises(AssertionError, match=expected) as info:
    run_block(README, 7, "a = 1\nundefined_name\n", {})
  # The traceback of the cause points at the page's own line numbering.
  assert info.value.__cause__.__traceback__.tb_next.tb_lineno == 8
