#!/usr/bin/env bash
# Builds here the wheel that device_check.sh would build on the device machine
# (Hopper only, sm_90a), so that a fresh machine installs it in seconds
# instead of spending minutes of device time on the build:
#   tools/prebuild_hopper.sh [SOURCES [OUT]]   # default: this tree into prebuilt/
#   run(command="PREBUILT=prebuilt ... tools/device_check.sh", carry=["prebuilt"])
# SOURCES is a directory or a git revision of this repository (its whole
# tree, archived: nothing the package ships is left out, as LICENSE was from
# an archive of a few paths, which test_license_is_shipped then failed on).
# The wheel goes to OUT with SOURCES (tools/sources_hash.sh of the sources
# built) and NVCC (this nvcc's release line): device_check.sh installs it only
# where both match its own tree and nvcc, and builds there otherwise. A wheel
# of the build before a change (`tools/prebuild_hopper.sh main
# prebuilt_before`) is tools/ab_bench.py's first argument. Keep OUT out of
# git (.gitignore has /prebuilt/; add others to .git/info/exclude) and carry
# it. PYTHON names an interpreter of the device's Python version (3.12: the
# wheel's tag must match; pip fetches the build requirements).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
if [[ -n ${1:-} && ! -d $1 ]]; then
  git -C "$repo" rev-parse --verify --quiet "$1^{commit}" >/dev/null \
    || { echo "SOURCES: $1 is neither a directory nor a git revision" >&2; exit 1; }
  sources=$(mktemp -d)
  trap 'rm -rf "$sources"' EXIT
  git -C "$repo" archive "$1" | tar -x -C "$sources"
else
  sources=$(realpath "${1:-$repo}")
fi
out=$(realpath -m "${2:-$repo/prebuilt}")
python=${PYTHON:-python3.12}
if [[ $sources == "$repo" ]] && ! git -C "$repo" diff --quiet HEAD -- cpp jax_tiled CMakeLists.txt pyproject.toml; then
  echo "note: building uncommitted changes under cpp/, jax_tiled/ or the build files" >&2
fi
rm -rf "$out" && mkdir -p "$out"
CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=90a}" \
  "$python" -m pip wheel --no-deps -w "$out" "$sources" >"$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log"; exit 1; }
rm "$out/build.log"
(cd "$sources" && bash "$repo/tools/sources_hash.sh") >"$out/SOURCES"
nvcc --version | grep release >"$out/NVCC"
ls -l "$out"
echo "sources $(cat "$out/SOURCES"): carry $(basename "$out") (device_check.sh: PREBUILT=$(basename "$out"))"
