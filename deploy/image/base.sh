#!/usr/bin/env bash
# Bootstrap a Debian bookworm base image locally with mmdebstrap and buildah, for machines that
# reach a Debian mirror but no container registry:
#
#   deploy/image/base.sh [--tag TAG] [--mirror URL]
#
# then build on it with: deploy/image/build.sh --base TAG
set -euo pipefail
tag=localhost/mrc-agent-base:bookworm
mirror=http://deb.debian.org/debian
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) tag=$2; shift 2 ;;
        --mirror) mirror=$2; shift 2 ;;
        -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "base.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mmdebstrap --quiet --variant=apt --include=python3,python3-venv,ca-certificates \
    --aptopt='APT::Install-Recommends "false"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$tmp/rootfs.tar" "$mirror"
ctr=$(buildah from scratch)
buildah add --quiet "$ctr" "$tmp/rootfs.tar" /
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/sh "$ctr"
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
echo "built $tag"
