"""experiments/sources_sha.sh names the library code a device run used (the device copy's .git
can be older than its tree): the hash of a work tree must equal the hash of the commit it was
checked out from, and must change when any library source does. Checked on a throwaway git
repository with the two library directories."""

from __future__ import annotations

import os
import subprocess

from helpers import REPO_ROOT as ROOT

SCRIPT = os.path.join(ROOT, "experiments", "sources_sha.sh")


def _sha(repo, *rev):
  out = subprocess.run(["bash", SCRIPT, *rev], cwd=repo, check=True, capture_output=True,
                       text=True).stdout.strip()
  assert len(out) == 64 and all(ch in "0123456789abcdef" for ch in out), out
  return out


def test_tree_and_commit_hashes_agree_and_follow_the_sources(tmp_path):
  git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
  for rel, text in (("lineax_attn/ops/a.py", "A = 1\n"), ("pallas_kernels/gpu/b.py", "B = 2\n"),
                    ("docs/c.md", "not library code\n")):
    os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
    (tmp_path / rel).write_text(text)
  git("init", "-q")
  git("add", ".")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
  first = _sha(tmp_path)
  assert _sha(tmp_path, "HEAD") == first
  (tmp_path / "docs/c.md").write_text("edited docs\n")            # not library code
  assert _sha(tmp_path) == first
  (tmp_path / "pallas_kernels/gpu/b.py").write_text("B = 3\n")     # a kernel source
  assert _sha(tmp_path) != first
  assert _sha(tmp_path, "HEAD") == first                           # the commit's, unchanged
