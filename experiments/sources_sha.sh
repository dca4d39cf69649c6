#!/bin/bash
# Which library code ran: the sha256 of lineax_attn/ and pallas_kernels/ Python sources, as
# the device runners record it (their `git log` reads the device copy's .git, which can be
# older than the tree it was sent with: 2026-12-06 it named the session's first commit while
# the tree held four later ones). On the CPU side, name the commit a recorded hash belongs to:
#
#   bash experiments/sources_sha.sh          # the work tree's
#   bash experiments/sources_sha.sh REV      # commit REV's (from git, not the tree)
set -u
if [ $# -gt 0 ]; then
  dir=$(mktemp -d); trap 'rm -rf $dir' EXIT
  git archive "$1" lineax_attn pallas_kernels | tar x -C "$dir" && cd "$dir" || exit 1
fi
find lineax_attn pallas_kernels -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -d' ' -f1
