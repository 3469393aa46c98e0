#!/usr/bin/env bash
# Install checkov into its own virtual environment, .venv-checkov/ at the repository root.
# checkov pins old versions of shared packages (packaging<24, networkx<2.7, boto3==..., its own
# `hcl2` fork), which conflict with pytest and python-hcl2 in the project's .venv, so it lives apart.
# tests/infra/test_checkov.py finds it there (or via $SCOREFN_CHECKOV, or `checkov` on PATH).
set -euo pipefail
CHECKOV_VERSION="${CHECKOV_VERSION:-3.3.30}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${CHECKOV_VENV:-$ROOT/.venv-checkov}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV/bin/checkov" ] && [ "$("$VENV/bin/checkov" --version 2>/dev/null)" = "$CHECKOV_VERSION" ]; then
  exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "checkov==$CHECKOV_VERSION"
"$VENV/bin/checkov" --version
