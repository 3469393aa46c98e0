"""checkov, offline, on the Containerfile, both Terraform modules and the rendered Kubernetes overlays.

checkov lives in its own virtual environment (infra/tools/install-checkov.sh): its pinned
dependencies conflict with the project's test tools. Skipped checks are listed, with the reason for
each, in .checkov.yaml at the repository root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.infra.conftest import CONTAINERFILE, INFRA, OVERLAYS, REPO, require_tool, run

CONFIG = REPO / ".checkov.yaml"
# No network: --skip-download (no platform policies, guidelines or suppressions) and no version check.
OFFLINE_ENV = {"CKV_SKIP_PACKAGE_UPDATE_CHECK": "true", "BC_SKIP_MAPPING": "TRUE", "LOG_LEVEL": "WARNING"}


def checkov_binary() -> Path:
    override = os.environ.get("SCOREFN_CHECKOV")
    extra = [Path(override)] if override else []
    return require_tool("checkov", "run infra/tools/install-checkov.sh, or set SCOREFN_CHECKOV",
                        *extra, REPO / ".venv-checkov" / "bin" / "checkov")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, rendered: dict[str, list[dict[str, Any]]],
           rendered_batch: dict[str, list[dict[str, Any]]]) -> list[dict]:
    checkov = checkov_binary()
    # One scan over a staging dir: checkov recognises Dockerfiles by name only, and scans the
    # manifests as kustomize renders them (the overlays are patches, not whole resources).
    stage = tmp_path_factory.mktemp("checkov")
    shutil.copy(CONTAINERFILE, stage / "Dockerfile")
    for module in ("cloudrun", "gke"):
        shutil.copytree(INFRA / module, stage / module, ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    (stage / "k8s").mkdir()
    for overlay in OVERLAYS:
        (stage / "k8s" / f"{overlay}.yaml").write_text(yaml.safe_dump_all(rendered[overlay]))
        (stage / "k8s" / f"batch-{overlay}.yaml").write_text(yaml.safe_dump_all(rendered_batch[overlay]))
    result = run([checkov, "--directory", stage, "--config-file", CONFIG,
                  "--framework", "dockerfile", "terraform", "kubernetes",
                  "--skip-download", "--output", "json"],
                 cwd=stage, env={**os.environ, **OFFLINE_ENV})
    assert result.stdout.strip(), f"checkov printed nothing (rc {result.returncode}):\n{result.stderr[-3000:]}"
    parsed = json.loads(result.stdout)
    return parsed if isinstance(parsed, list) else [parsed]


@pytest.mark.parametrize("framework", ["dockerfile", "terraform", "kubernetes"])
def test_checkov_finds_nothing(report: list[dict], framework: str) -> None:
    (scan,) = [r for r in report if r["check_type"] == framework]
    assert scan["summary"]["passed"] > 0, f"checkov ran no {framework} check"
    failed = [f"{c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}"
              for c in scan["results"]["failed_checks"]]
    assert not failed, "\n".join(failed)
    assert scan["summary"]["parsing_errors"] == 0


def test_every_skipped_check_says_why() -> None:
    lines = CONFIG.read_text().splitlines()
    skipped = yaml.safe_load(CONFIG.read_text())["skip-check"]
    assert skipped
    for check in skipped:
        at = next(i for i, line in enumerate(lines) if line.strip() == f"- {check}")
        assert lines[at - 1].strip().startswith("#"), f"{check} is skipped without a reason above it"
        assert re.fullmatch(r"CKV2?_[A-Z0-9]+_\d+", check), check
