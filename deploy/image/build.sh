#!/usr/bin/env bash
# Build the mrc-agent sidecar image with buildah or docker, whichever is present.
#
#   deploy/image/build.sh [--base IMAGE] [--tag TAG] [--python-version X.Y] [--extras LIST]
#
# --extras is the agent's extras (default diagnose; diagnose,profiling for CUPTI PM sampling,
# with deploy/patches/profiling.yaml).
# The wheelhouse (the project's wheel and its dependencies' wheels for the image's Python and
# this machine's architecture) is made here on the host, then copied in: the build itself
# needs no network. --python-version must be the base image's Python (default: 3.11, that of
# python:3.11-slim-bookworm and of Debian bookworm).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
base=docker.io/library/python:3.11-slim-bookworm
tag=localhost/mrc-agent:0.1.0
pyver=3.11
extras=diagnose
while [ $# -gt 0 ]; do
    case "$1" in
        --base) base=$2; shift 2 ;;
        --tag) tag=$2; shift 2 ;;
        --python-version) pyver=$2; shift 2 ;;
        --extras) extras=$2; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp "$here/Containerfile" "$ctx/"
# Build from a copy of the working tree (tracked and not-ignored files, as git sees it), so
# that setuptools' build/ and egg-info never land in the checkout.
mkdir "$ctx/src"
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$repo" ls-files -z --cached --others --exclude-standard \
        | (cd "$repo" && tar --null -T - -cf -) | tar -xf - -C "$ctx/src"
else
    cp -a "$repo/." "$ctx/src/"
fi
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$ctx/wheels" "$ctx/src"
arch=$(uname -m)
# Binary wheels only, for the image's Python and any glibc from manylinux2014 up to bookworm's.
set --
for p in manylinux_2_36 manylinux_2_34 manylinux_2_28 manylinux_2_17 manylinux2014; do
    set -- "$@" --platform "${p}_${arch}"
done
set -- "$@" --platform any
wheel=$(ls "$ctx"/wheels/mrc_agent-*.whl)
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version "$pyver" --implementation cp "$@" -d "$ctx/wheels" "${wheel}[${extras}]"
version=$(basename "$wheel" | cut -d- -f2)
revision=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
created=$(date -u +%Y-%m-%dT%H:%M:%SZ)
if command -v buildah >/dev/null 2>&1; then
    # vfs and chroot isolation: no kernel overlay or user namespaces needed (CI, nested).
    STORAGE_DRIVER=${STORAGE_DRIVER:-vfs} buildah bud --quiet --isolation chroot --layers=false \
        --build-arg BASE_IMAGE="$base" --build-arg VERSION="$version" --build-arg EXTRAS="$extras" \
        --build-arg REVISION="$revision" --build-arg CREATED="$created" \
        -f "$ctx/Containerfile" -t "$tag" "$ctx"
elif command -v docker >/dev/null 2>&1; then
    docker build --build-arg BASE_IMAGE="$base" --build-arg VERSION="$version" --build-arg EXTRAS="$extras" \
        --build-arg REVISION="$revision" --build-arg CREATED="$created" \
        -f "$ctx/Containerfile" -t "$tag" "$ctx"
else
    echo "build.sh: neither buildah nor docker is installed" >&2
    exit 2
fi
echo "built $tag (mrc-agent $version, base $base)"
