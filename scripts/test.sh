#!/usr/bin/env bash
# Run the test suite (testpaths come from pyproject.toml) in the project venv.
# Arguments pass straight through to pytest, e.g. scripts/test.sh -m "not slow".
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup_env.sh

# OMP_NUM_THREADS is deliberately not set here: the tests manage it themselves.
# no:cacheprovider keeps .pytest_cache out of the tree; --durations=20 lists the slowest tests
# (CI's limit is 90 minutes, the aim under 15: see which tests to trim).
# Two pytest-xdist workers, a test module per worker at a time (--dist loadfile: the module-scoped
# fixtures, e.g. the S3 server, are made once per module, as in one process), the modules marked slow
# handed out first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order). The jobs
# the tests start are forked from tests/forkserver.py's server (torch and Lightning imported once per
# worker). 14 min 11 s on 2 cores beside a CPU-bound process on one of them (2026-11-28, 937 tests).
# TEST_WORKERS=0 runs it in one process; -n/--dist passed to this script win over these.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" 2>&1 \
    | tee "$log"
rc=${PIPESTATUS[0]}
set -e

echo "test.sh: pytest summary: $(grep -v '^\s*$' "$log" | tail -n 1)"
if [[ $rc -eq 5 ]]; then
    # pytest's "no tests collected" would otherwise let an empty run pass.
    echo "test.sh: no tests were collected; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
