#!/usr/bin/env bash
# What a real Kubernetes 1.20 node needs on this machine (docs/DEVELOPMENT.md, "A real node"):
# the kubelet and kube-proxy built from the control plane's own tree, Debian's containerd (1.6,
# CRI v1alpha2), runc and CNI plugins, a pause image, and our images inside containerd.
#
#   scripts/node.sh prepare           tools (apt-get), kubelet + kube-proxy (control-plane.sh build-node),
#                                     the images (scripts/images.sh; DILOCO_IMAGES_REUSE=1: --reuse)
#                                     and the pause image (a 20-line C program, built here)
#   scripts/node.sh import SOCKET     the syncer, learner and pause images into the containerd at
#                                     SOCKET (namespace k8s.io), each only when buildah's image ID
#                                     changed since its last import
#
# tests/cluster/node.py starts the processes (containerd, kubelet, kube-proxy, a DNS server);
# `make test-cluster` runs the whole lane. Root: containerd, runc, iptables and mounts need it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${DILOCO_NODE_STATE:-/var/lib/diloco-node}
IMAGES_STATE=${DILOCO_IMAGES_STATE:-/var/tmp/diloco-images}
LEARNER=${DILOCO_LEARNER_IMAGE:-localhost/diloco/learner:dev}
SYNCER=${DILOCO_SYNCER_IMAGE:-localhost/diloco/syncer:dev}
PAUSE=${DILOCO_PAUSE_IMAGE:-localhost/diloco/pause:1}
RUNTIME=${DILOCO_OCI_RUNTIME:-/usr/sbin/runc}

say() { echo "[node $(date -u +%H:%M:%S)] $*" >&2; }
die() { echo "node.sh: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root: containerd, runc, iptables and the kubelet's mounts need it"
export CONTAINERS_CONF=$IMAGES_STATE/containers.conf

tools() {
  local need=()
  command -v containerd >/dev/null || need+=(containerd)
  command -v ctr >/dev/null || need+=(containerd)
  [ -x "$RUNTIME" ] || need+=(runc)
  [ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
  command -v iptables >/dev/null || need+=(iptables)
  command -v conntrack >/dev/null || need+=(conntrack)
  command -v gcc >/dev/null || need+=(gcc libc6-dev)
  [ ${#need[@]} -eq 0 ] && return
  say "installing ${need[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

# The pod sandbox's image: a process that sleeps, reaps orphans and exits on SIGINT/SIGTERM.
# No registry is reachable for the usual k8s.gcr.io/pause.
pause_image() {
  if buildah inspect --type image "$PAUSE" >/dev/null 2>&1; then
    return
  fi
  say "building $PAUSE"
  local dir
  dir=$(mktemp -d)
  cat > "$dir/pause.c" <<'EOF'
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, 0, WNOHANG) > 0) {
  }
}

int main(void) {
  signal(SIGINT, stop);
  signal(SIGTERM, stop);
  signal(SIGCHLD, reap);
  for (;;) pause();
}
EOF
  gcc -static -Os -o "$dir/pause" "$dir/pause.c"
  strip "$dir/pause" 2>/dev/null || true
  local c
  c=$(buildah from scratch)
  buildah copy --quiet "$c" "$dir/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 "$c"
  buildah commit --quiet --rm "$c" "$PAUSE" >/dev/null
  rm -rf "$dir"
}

prepare() {
  tools
  bash "$ROOT/scripts/control-plane.sh" build
  bash "$ROOT/scripts/control-plane.sh" build-node
  local reuse=()
  [ "${DILOCO_IMAGES_REUSE:-}" = 1 ] && reuse=(--reuse)
  bash "$ROOT/scripts/images.sh" "${reuse[@]}" >&2
  pause_image
}

# `buildah push` writes an OCI archive; ctr imports it under the name given after the file name.
import_images() {
  local socket=$1 ctr=(ctr --address "$1" --namespace k8s.io)
  mkdir -p "$STATE/imported"
  local image id stamp present tmp
  for image in "$PAUSE" "$SYNCER" "$LEARNER"; do
    id=$(buildah inspect --type image --format '{{.FromImageID}}' "$image")
    stamp=$STATE/imported/$(echo "$image" | tr '/:' '__')
    present=$("${ctr[@]}" images ls --quiet "name==$image")
    if [ -n "$present" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$id" ]; then
      say "$image already in containerd (image ${id:0:12})"
      continue
    fi
    say "importing $image (image ${id:0:12}) into containerd"
    # The previous import, under its name and the image-ID name the CRI plugin gives it: left
    # there, it keeps its layers (a few GB) referenced.
    [ -f "$stamp" ] && "${ctr[@]}" images rm "$image" "sha256:$(cat "$stamp")" >/dev/null 2>&1 || true
    tmp=$(mktemp -d "$STATE/import.XXXXXX")
    buildah push --quiet --disable-compression "$image" "oci-archive:$tmp/image.tar:$image" >/dev/null
    "${ctr[@]}" images import "$tmp/image.tar" >/dev/null
    rm -rf "$tmp"
    echo "$id" > "$stamp"
  done
  "${ctr[@]}" images ls | awk 'NR == 1 || /localhost\/diloco/' | cut -c1-120 >&2
}

case ${1:-} in
  prepare) prepare ;;
  import) [ $# -eq 2 ] || die "usage: $0 import SOCKET"; import_images "$2" ;;
  *) sed -n '2,14p' "$0" >&2; exit 2 ;;
esac
