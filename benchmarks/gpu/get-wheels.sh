#!/bin/bash
# Download the wheels the GPU machine lacks into ./.whl (run from the project root, on the dev machine), and build
# Primus's own from a git revision (default HEAD: committed code only, whatever the working tree holds).
# The GPU machine has Python 3.12 and torch 2.11 + triton 3.6 but no megatron-core / torchtitan and no registry
# access: the device tool carries .whl (name it in `carry`), and `source benchmarks/gpu/install.sh` installs it there.
#
#   [MCORE=0.16.1] benchmarks/gpu/get-wheels.sh [REV]
set -euo pipefail
shopt -s nullglob
rev=${1:-HEAD}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "$@"; }
# engines (pins match the project's: megatron-core 0.19.2 is what Python 3.12 takes; MCORE=0.16.1 gives the earlier
# pin, which primus-megatron also runs) and what they import that the GPU image lacks
dl megatron-core==${MCORE:-0.19.2} "packaging>=24.2" torchtitan==0.2.2 tomli pluggy==1.7.0 nvmath-python==1.0.0 \
   torchdata==0.11.0 tyro docstring-parser typeguard shtab \
   datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
# light deps the GPU image lacks (it has pyyaml, typer, rich, safetensors, tokenizers, tensorboard; no pydantic)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl pydantic   # with its exact pydantic-core
# the project's own packages at REV, built here (pure Python), so their entry points exist there too
src=$(mktemp -d)
git archive "$rev" packages | tar -x -C "$src"
rm -f .whl/primus_*.whl
for d in "$src"/packages/*/; do
  [ -f "$d/pyproject.toml" ] || continue
  python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "$d" 2>/dev/null || python3 -m pip wheel -q --no-deps -w .whl "$d"
done
rm -rf "$src"
git rev-parse --short "$rev" > .whl/REVISION
ls .whl; du -sh .whl
