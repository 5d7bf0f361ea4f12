#!/usr/bin/env bash
# Run the end-to-end demo in the project venv; arguments pass to examples/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup_env.sh demo   # torch, Lightning and the package: nothing the tests alone need
exec .venv/bin/python examples/demo.py "$@"
