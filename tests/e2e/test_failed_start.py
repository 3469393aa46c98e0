"""A start that fails ends the process: `scorefn serve` exits non-zero within seconds of the failure, its last
lines naming the cause, instead of an instance that never turns ready and keeps billing."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from runtime.tools.serverproc import SMALL_BUCKETS, free_port, serve_command

pytestmark = pytest.mark.slow
FAULTS = Path(__file__).resolve().parent / "faults"  # its sitecustomize injects the faults below
EXIT_WITHIN_S = 60.0  # of start-up: the failures below come before or during compilation
LAST_LINES = 6


def failed_start(tmp_path: Path, interface: str = "asgi", **env: str) -> tuple[int, float, list[str]]:
    """Run `scorefn serve` until it exits; (exit status, seconds, its output lines). Fails if it is still running."""
    full_env = {**os.environ, **SMALL_BUCKETS, "PORT": str(free_port()), "SCOREFN_HOST": "127.0.0.1",
                "SCOREFN_COMPILE_CACHE_DIR": str(tmp_path / "xla"),
                "PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]), **env}
    started = time.monotonic()
    try:
        done = subprocess.run(serve_command(interface), env=full_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"still running after {EXIT_WITHIN_S} s:\n{timeout.output}")
    return done.returncode, time.monotonic() - started, done.stdout.splitlines()


def assert_exited_naming(result: tuple[int, float, list[str]], *fragments: str) -> dict:
    """Non-zero exit, and one CRITICAL line among the last ones naming every fragment, with the traceback."""
    status, _, lines = result
    assert status != 0, "\n".join(lines)
    records = []
    for line in lines[-LAST_LINES:]:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # granian's own lines ("Unexpected exit from worker-1", "Shutting down granian")
    (failure,) = [r for r in records if r.get("severity") == "CRITICAL"]
    assert failure["message"].startswith("engine start failed, exiting: ")
    for fragment in fragments:
        assert fragment in failure["message"], failure["message"]
    assert "Traceback" in failure["exception"]
    assert sum('"engine start failed' in line for line in lines) == 1  # logged once
    return failure


def test_a_verbalizer_longer_than_a_label_may_be_names_the_classifier_label_and_word(tmp_path):
    toml = tmp_path / "classifiers.toml"
    toml.write_text('[[classifier]]\nname = "mood"\ntemplate = "Text: {input}\\nMood:"\n'
                    'labels = { happy = " happy", grumpy = " grumpily" }\n')
    assert_exited_naming(failed_start(tmp_path, SCOREFN_CLASSIFIERS=str(toml), SCOREFN_MAX_LABEL_TOKENS="1"),
                         "ClassifierError", "classifier 'mood'", "label 'grumpy'", "' grumpily'",
                         "SCOREFN_MAX_LABEL_TOKENS=1")


def test_a_missing_dependency(tmp_path):
    # The built-in sentiment classifier renders SmolLM2's chat template, which needs jinja2.
    assert_exited_naming(failed_start(tmp_path, SCOREFN_TEST_MISSING="jinja2"), "jinja2")


def test_a_bad_model(tmp_path):
    assert_exited_naming(failed_start(tmp_path, SCOREFN_MODEL=str(tmp_path / "no-such-model")),
                         "ModelConfigError", "no-such-model: not a model directory")


def test_a_mesh_that_cannot_be_built(tmp_path):
    assert_exited_naming(failed_start(tmp_path, SCOREFN_MESH="2x1"),
                         "MeshError", "SCOREFN_MESH=2x1 needs 2 devices, this host has 1")


def test_a_compile_failure(tmp_path):
    assert_exited_naming(failed_start(tmp_path, SCOREFN_TEST_COMPILE_FAILS="1"),
                         "RuntimeError", "injected by the test")


def test_the_wsgi_face_exits_too(tmp_path):
    status, seconds, lines = failed_start(tmp_path, "wsgi", SCOREFN_MODEL=str(tmp_path / "no-such-model"))
    assert_exited_naming((status, seconds, lines), "not a model directory")


def test_a_lora_adapter_that_is_not_there_names_it(tmp_path):
    assert_exited_naming(failed_start(tmp_path, SCOREFN_LORA_ADAPTERS=f"judge={tmp_path / 'judge'}"),
                         "AdapterError", "LoRA adapter 'judge'", "adapter_config.json")
