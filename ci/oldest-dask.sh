#!/usr/bin/env bash
# The scheduler, worker and client tests against the oldest dask and distributed that
# setup.cfg allows (its floor, read from there). The scheduler plugin's placement reads
# distributed's task states, which change between releases without deprecation: CI tests
# the floor here and the newest allowed release (constraints.txt) in the main run.
# Run inside the project's environment (the rest of the packages come from it).
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^ *distributed>=\([0-9][0-9.]*\).*/\1/p' setup.cfg)
[ -n "$floor" ] || { echo "ci/oldest-dask.sh: no distributed>= floor in setup.cfg" >&2; exit 1; }
target="${TMPDIR:-/tmp}/dask-pcm-oldest-dask-$floor"
if [ ! -d "$target/distributed" ]; then
    pip install --quiet --no-deps --target "$target" "dask==$floor" "distributed==$floor"
fi
# Only dask and distributed come from $target; PYTHONPATH puts them before the environment's.
PYTHONPATH="$target" python -c "
import dask, distributed, sys
found = (dask.__version__, distributed.__version__)
sys.exit(0 if found == ('$floor', '$floor') else f'expected dask and distributed $floor, got {found}')
"
echo "ci/oldest-dask.sh: tests/scheduler tests/worker tests/test_client.py on dask and distributed $floor"
PYTHONPATH="$target" python -m pytest -p no:nbmake -o addopts="-ra --strict-markers" \
    tests/scheduler tests/worker tests/test_client.py
