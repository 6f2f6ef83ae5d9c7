#!/usr/bin/env bash
# Run HERE, before benchmarks/h200_check.sh goes to a device machine: fetches every wheel the
# check installs into a virtual environment there (Python 3.12, x86_64; the machine has
# torch, numpy, prometheus-client and PyYAML, which the venv sees through
# --system-site-packages) into .whl/, which .git/info/exclude keeps out of git and the device
# call carries. cupti-python finds libcupti through cuda-pathfinder, which looks in the
# interpreter's site-packages, so the pinned nvidia-cuda-cupti must be installed there, not
# put on PYTHONPATH.
#   bash benchmarks/h200_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# One pin per distribution h200_check.sh requires (tests/unit/test_h200_scripts.py holds the two
# lists together). cupti-python >= 13.4 has the single-pass set API; it wants
# nvidia-cuda-cupti ~= 13.4, pinned to the CUPTI whose sets tests/data/cupti_sets records.
PINS=(
    cupti-python==13.4.0
    nvidia-cuda-cupti==13.4.92
    cuda-bindings==13.5.0
    cuda-pathfinder==1.9.1
    nvidia-ml-py==13.615.71
    pyelftools==0.33
    bcrypt==5.0.0
)
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_25_x86_64 \
    --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${PINS[@]}"
printf '%s\n' "${PINS[@]}" > .whl/PINS
# The project's own wheel, built from this working tree (committed or not), as shipped.
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$src"
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
    -w .whl "$src"
ls .whl
du -sh .whl
