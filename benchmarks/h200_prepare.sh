#!/usr/bin/env bash
# Run HERE, before benchmarks/h200_check.sh goes to a device machine: fetches the wheels that
# machine lacks (Python 3.12; it has torch, nvidia-ml-py, prometheus-client, PyYAML,
# cuda-bindings and numpy; not bcrypt, which the agent's web configuration imports) into .whl/, which .git/info/exclude keeps out of git and the device call carries.
#   bash benchmarks/h200_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
# cupti-python >= 13.3 has pm_sampling; it wants its own libcupti (nvidia-cuda-cupti ~= 13.4).
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_25_x86_64 \
    --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    cupti-python==13.4.0 nvidia-cuda-cupti==13.4.92 pyelftools==0.33 bcrypt==5.0.0
du -sh .whl
