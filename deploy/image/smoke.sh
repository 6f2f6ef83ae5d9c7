#!/usr/bin/env bash
# Run the built image's agent against a process on this host and check what it exports:
#
#   deploy/image/smoke.sh [--tag TAG]
#
# buildah's chroot isolation shares the host's network and PID namespace, which is what a
# sidecar with shareProcessNamespace sees of its pod. (podman run needs cgroups that not every
# CI machine has; buildah run does not.) Exit 0 when the agent, as the image's non-root user,
# served the target's CPU series; non-zero with the reason otherwise.
set -euo pipefail
tag=localhost/mrc-agent:0.1.0
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) tag=$2; shift 2 ;;
        *) echo "smoke.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
tmp=$(mktemp -d)
# buildah applies default ulimits to the container (nofile 1048576); where they exceed this
# machine's hard limit the run is refused, so hand it the limit this shell already has.
nofile=$(ulimit -Hn)
cat > "$tmp/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile"]
CONF
export CONTAINERS_CONF="$tmp/containers.conf"
ctr=$(buildah from --quiet "$tag")
python3 -c 'while True: pass' &
spinner=$!
agent=""
cleanup() {
    kill "$spinner" 2>/dev/null || true
    [ -z "$agent" ] || kill "$agent" 2>/dev/null || true
    buildah rm "$ctr" >/dev/null 2>&1 || true
    rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "smoke.sh: FAIL: $*" >&2; sed 's/^/  agent: /' "$tmp/agent.log" >&2 || true; exit 1; }

user=$(buildah inspect --format '{{.OCIv1.Config.User}}' "$tag")
[ "$user" = "65532:65532" ] || fail "the image runs as '$user', not 65532:65532"
entry=$(buildah inspect --format '{{.OCIv1.Config.Entrypoint}}' "$tag")
[ "$entry" = '[mrc-agent]' ] || fail "entrypoint is $entry"
buildah inspect --format '{{index .OCIv1.Config.Labels "org.opencontainers.image.version"}}' \
    "$tag" | grep -q . || fail "no org.opencontainers.image.version label"
if buildah run --isolation chroot "$ctr" -- python3 -c 'import torch' >/dev/null 2>&1; then
    fail "torch is in the agent's image"
fi
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
buildah run --isolation chroot "$ctr" -- mrc-agent run --listen "127.0.0.1:$port" \
    --gpu-backend none --pid "$spinner" --interval 0.5 >"$tmp/agent.log" 2>&1 &
agent=$!
i=0
until curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1; do
    i=$((i + 1))
    [ $i -lt 60 ] || fail "the agent in the image did not get ready within 30 s"
    kill -0 "$agent" 2>/dev/null || fail "the agent in the image exited"
    sleep 0.5
done
sleep 2
curl -fsS "http://127.0.0.1:$port/metrics" >"$tmp/metrics"
grep -q "^mrc_process_cpu_user_ratio{pid=\"$spinner\"" "$tmp/metrics" \
    || fail "no CPU ratio of the host's pid $spinner"
ratio=$(sed -n "s/^mrc_process_cpu_user_ratio{pid=\"$spinner\"[^}]*} //p" "$tmp/metrics")
python3 -c "import sys; sys.exit(0 if float('$ratio') > 0 else 1)" \
    || fail "the spinner's user CPU ratio is $ratio"
grep -q '^mrc_agent_collector_success{collector="process"} 1' "$tmp/metrics" \
    || fail "the process collector did not succeed"
echo "smoke.sh: ok: $tag as $user served pid $spinner at $ratio of a core"
