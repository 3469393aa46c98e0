#!/usr/bin/env bash
# Install checkov into its own virtual environment, .venv-checkov/ at the repository root, from lock/checkov.txt.
# checkov pins old versions of shared packages (packaging<24, networkx<2.7, boto3==..., its own
# `hcl2` fork), which conflict with pytest and python-hcl2 in the project's .venv, so it lives apart.
# tests/infra/test_checkov.py finds it there (or via $SCOREFN_CHECKOV, or `checkov` on PATH).
# With $UV (make test passes .venv-uv/bin/uv) uv installs the lock in seconds; without it, pip does.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LOCK="$ROOT/lock/checkov.txt"
CHECKOV_VERSION="$(sed -n 's/^checkov==\([^ ]*\).*/\1/p' "$LOCK")"
VENV="${CHECKOV_VENV:-$ROOT/.venv-checkov}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV/bin/checkov" ] && [ "$("$VENV/bin/checkov" --version 2>/dev/null)" = "$CHECKOV_VERSION" ]; then
  exit 0
fi
if [ -n "${UV:-}" ]; then
  "$UV" venv --quiet --allow-existing --python "$PYTHON" "$VENV"
  "$UV" pip sync --quiet --require-hashes --python "$VENV/bin/python" "$LOCK"
else
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --require-hashes -r "$LOCK"
fi
"$VENV/bin/checkov" --version
