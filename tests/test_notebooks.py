"""The notebooks in notebooks/ stay in sync with their jupytext sources and run without errors.

* Sync: each `.ipynb` has the cells (type and source) of its percent-format `.py`, the source of
  truth (regenerate with `jupytext --to ipynb notebooks/<name>.py`).
* Execution: each notebook runs top to bottom in a fresh kernel of this interpreter, in fast mode
  (`LINEAX_NOTEBOOK_FAST=1`, tiny sizes), in a temporary directory; the executed copy stays in
  memory, so outputs are never written back to the repository.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = ("inspect_state", "compare_mixers", "routing")
KERNEL_NAME = "lineax-test-python3"
TIMEOUT_S = 300  # per cell; the whole fast notebook takes well under a minute


def _cells(notebook) -> list[tuple[str, str]]:
  return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_ipynb_in_sync_with_py(name):
  source = jupytext.read(NOTEBOOKS_DIR / f"{name}.py")
  paired = nbformat.read(NOTEBOOKS_DIR / f"{name}.ipynb", as_version=4)
  assert _cells(paired) == _cells(source), (
      f"notebooks/{name}.ipynb is out of date: run `jupytext --to ipynb notebooks/{name}.py`")
  assert len(source.cells) > 3
  # Committed without outputs: what they show comes from running them.
  assert all(not cell.get("outputs") for cell in paired.cells)


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
  """A kernelspec that runs this interpreter (the venv's), and a fast, CPU-only environment."""
  root = tmp_path_factory.mktemp("jupyter")
  spec_dir = root / "kernels" / KERNEL_NAME
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "lineax_attn tests", "language": "python"}))
  repo = str(NOTEBOOKS_DIR.parent)
  env = {
      "JUPYTER_PATH": str(root),
      "LINEAX_NOTEBOOK_FAST": "1",
      "JAX_PLATFORMS": "cpu",
      # Tiny models: compile fast rather than run fast (the notebooks are mostly compile time).
      "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
      "MPLBACKEND": "module://matplotlib_inline.backend_inline",  # figures become outputs
      "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
  }
  saved = {key: os.environ.get(key) for key in env}
  os.environ.update(env)
  os.environ.pop("LINEAX_NOTEBOOK_CHECKPOINT", None)
  yield root
  for key, value in saved.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, kernel_env, tmp_path):
  notebook = nbformat.read(NOTEBOOKS_DIR / f"{name}.ipynb", as_version=4)
  client = NotebookClient(notebook, timeout=TIMEOUT_S, kernel_name=KERNEL_NAME,
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError (with the cell and traceback) on any error
  outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
  assert not [out for out in outputs if out.output_type == "error"]
  images = [out for out in outputs if "image/png" in out.get("data", {})]
  assert images, f"{name} drew no figure"
  assert not list(tmp_path.glob("*.ipynb"))  # nothing written, here or in the repo
