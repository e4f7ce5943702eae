#!/usr/bin/env bash
# One device visit: compute-sanitizer memcheck + racecheck of the pair gemv, then the whole GPU test suite
# (simulator off) spread over the machine's cores with pytest-xdist, with the slowest tests printed.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
timeout 100 compute-sanitizer --tool memcheck python benchmarks/sanitize.py pair 2>&1 | tail -3
timeout 100 compute-sanitizer --tool racecheck python benchmarks/sanitize.py pair 2>&1 | tail -3
cd tests && /usr/bin/time -f "suite wall %e s" timeout 420 python -m pytest -q -n 16 -p no:cacheprovider --durations=8 . 2>&1 | grep -v "Warning\|warn(" | tail -22
