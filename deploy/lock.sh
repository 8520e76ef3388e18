#!/usr/bin/env bash
# Regenerates the pinned, hashed dependency sets the container image installs:
#   requirements.lock        what `relay` needs at run time, every sink's extra included
#   requirements-build.lock  the build backend that turns the source into a wheel
# Run it (from anywhere) after changing dependencies in pyproject.toml, with the Python
# minor version the Dockerfile uses (3.11), and commit both files. It reads PyPI only:
# local pip configuration (mirrors, find-links) is ignored so the hashes are PyPI's.
set -euo pipefail
cd "$(dirname "$0")/.."

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL
export CUSTOM_COMPILE_COMMAND="deploy/lock.sh"

${PYTHON:-python3} -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "pip-tools==7.6.2"
compile=("$tmp/venv/bin/pip-compile" --quiet --generate-hashes --strip-extras --allow-unsafe
         --no-emit-index-url --no-emit-find-links --no-emit-trusted-host --resolver=backtracking)

# Every sink's extra (the image runs whichever sink RELAY_SINK names), tracing's, and the
# console's (`relay console` runs from the same image).
"${compile[@]}" --extra nats --extra rabbitmq --extra otel --extra console --output-file requirements.lock pyproject.toml
# The [build-system] requirement, so the wheel is built by a pinned hatchling.
printf 'hatchling>=1.21\n' >"$tmp/build.in"
"${compile[@]}" --output-file requirements-build.lock "$tmp/build.in"
sed -i "s|$tmp/build.in|pyproject.toml [build-system]|" requirements-build.lock
