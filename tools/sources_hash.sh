#!/usr/bin/env bash
# What a build is built from, named by its sources: the first 12 hex digits of
# the SHA-1 of every file under cpp/ and jax_tiled/ (no .pyc), CMakeLists.txt
# and pyproject.toml, in byte order of their paths. Run in the repository
# root. device_check.sh stamps its build with it, and prebuild_hopper.sh the
# wheel it makes here; a copy of the tree on the device machine may carry
# another HEAD or index, so neither the commit nor `git ls-files` would say.
set -euo pipefail
find cpp jax_tiled CMakeLists.txt pyproject.toml -type f ! -name '*.pyc' -print0 \
  | LC_ALL=C sort -z | xargs -0 cat | sha1sum | cut -c1-12
