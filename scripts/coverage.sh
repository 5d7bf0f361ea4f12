#!/usr/bin/env bash
# Line coverage of ckpt_engine, lightning_ckpt and horovod_ckpt over the test suite, the processes the
# tests start included (ranks, jobs, torchrun, horovodrun: coverage's patch = subprocess, _exit, fork;
# see [tool.coverage] in pyproject.toml). Arguments pass to pytest, as with scripts/test.sh:
#
#   bash scripts/coverage.sh                     # the whole suite, then the report (about 1.3 x its time)
#   bash scripts/coverage.sh tests/test_plan.py  # one module
#
# The data goes to .coverage-data/ (ignored by git); the report ends with the total per package.
# Processes that are SIGKILLed write nothing, as always: what only they run is counted where another
# test runs it to its end.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup_env.sh
rm -rf .coverage-data
mkdir -p .coverage-data
set +e
.venv/bin/python -m coverage run -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder "$@"
rc=$?
set -e
.venv/bin/python -m coverage combine -q
.venv/bin/python -m coverage report --skip-empty --sort=cover | tail -n 40
for package in ckpt_engine lightning_ckpt horovod_ckpt; do
    echo "coverage: $package $(.venv/bin/python -m coverage report --include="$package/*" --format=total)% of lines"
done
exit "$rc"
