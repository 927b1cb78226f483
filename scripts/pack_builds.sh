#!/usr/bin/env bash
# Builds mla-bench and the GPU tests once per variant of the kernels' build-time knobs and packs
# their stripped binaries for a GPU machine (which then needs no build step):
#
#   scripts/pack_builds.sh DEST main= slack8=MLA_DECODE_MAX_SLACK=8 'both=A=1;B=2'
#
# Variant NAME=KNOBS builds in build-NAME (reused, so a second call is incremental) with
# -DMLA_DECODE_KNOBS=KNOBS (empty: the default build) and lands as DEST/NAME/tests/mla_gpu_tests
# and DEST/NAME/tools/mla-bench. DEST/COMMIT names the commit and each variant's knobs; DEST.tar.xz
# packs the folder (carry it and unpack with `tar xJf DEST.tar.xz -C <parent of DEST>`).
# MLA_CUDA_ARCHS (default 90a) and JOBS (default 2) are passed on.
set -euo pipefail

if (($# < 2)); then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
DEST="$1"
shift
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd -P)"
cd "$SRC_DIR"
commit="$(git rev-parse --short HEAD)$([[ -z "$(git status --porcelain -- src include tools tests CMakeLists.txt)" ]] || echo '+changes')"
echo "commit $commit" >"$DEST/COMMIT"
for variant in "$@"; do
  name="${variant%%=*}"
  knobs="${variant#*=}"
  if [[ -z "$name" || "$name" == "$variant" || ! "$name" =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "pack_builds: expected NAME=KNOBS (NAME of letters, digits, - or _), got '$variant'" >&2
    exit 2
  fi
  build="build-$name"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMLA_CUDA_ARCHS="${MLA_CUDA_ARCHS:-90a}" \
    -DMLA_DECODE_KNOBS="$knobs" >/dev/null
  ninja -C "$build" -j "${JOBS:-2}" tools/mla-bench tests/mla_gpu_tests
  mkdir -p "$DEST/$name/tests" "$DEST/$name/tools"
  cp "$build/tests/mla_gpu_tests" "$DEST/$name/tests/"
  cp "$build/tools/mla-bench" "$DEST/$name/tools/"
  strip "$DEST/$name/tests/mla_gpu_tests" "$DEST/$name/tools/mla-bench"
  echo "$name: ${knobs:-(default build)}" >>"$DEST/COMMIT"
done
tar cJf "$DEST.tar.xz" -C "$(dirname "$DEST")" "$(basename "$DEST")"
cat "$DEST/COMMIT"
ls -l "$DEST.tar.xz"
