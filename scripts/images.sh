#!/usr/bin/env bash
# Build the learner and syncer images with no Docker daemon and no registry (docs/IMAGES.md).
#
# No registry is reachable, so the Dockerfiles' base (`PYTHON_IMAGE`, python:3.11-slim upstream)
# is built here: Debian bookworm from debootstrap, its Python 3.11, and a venv at /opt/venv first
# on PATH (Debian's own Python is externally managed, PEP 668, and the Dockerfiles call plain
# `pip` and `python`). buildah builds; podman runs what it built (same storage). Both run as
# root with runc and the containers.conf written below: the default crun fails here on rlimits
# and hybrid cgroups.
#
#   scripts/images.sh              base image if missing (cached), then both images
#   scripts/images.sh --rebuild    rebuild the base image too
#   scripts/images.sh --base-only  only the base image
#   scripts/images.sh --reuse      build an image only where none is present (tests iterating)
#   scripts/images.sh --env        print the environment podman/buildah need here (eval it)
#
# The images are rebuilt with buildah's layer cache: an unchanged tree takes seconds, a changed
# one reruns the `pip install` (the learner image: JAX and the rest from PyPI).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${DILOCO_IMAGES_STATE:-/var/tmp/diloco-images}    # the debootstrap folder and containers.conf
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=${DILOCO_BASE_IMAGE:-localhost/diloco/python:3.11-bookworm}
LEARNER=${DILOCO_LEARNER_IMAGE:-localhost/diloco/learner:dev}
SYNCER=${DILOCO_SYNCER_IMAGE:-localhost/diloco/syncer:dev}
RUNTIME=${DILOCO_OCI_RUNTIME:-/usr/sbin/runc}
LABEL=io.diloco.images  # on the base, so inherited by every image and layer built on it
# The CAs the builds' `pip install` trusts: this machine's (its egress proxy has its own CA),
# mounted into each RUN step only, so the images never carry it. Empty: the image's own.
CA_BUNDLE=${DILOCO_BUILD_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}

rebuild=0 base_only=0 reuse=0 print_env=0
for arg in "$@"; do
  case $arg in
    --rebuild) rebuild=1 ;;
    --base-only) base_only=1 ;;
    --reuse) reuse=1 ;;
    --env) print_env=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "images.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "[images $(date -u +%H:%M:%S)] $*"; }
die() { echo "images.sh: $*" >&2; exit 1; }

write_conf() {
  mkdir -p "$STATE"
  cat > "$STATE/containers.conf" <<EOF
# Written by scripts/images.sh: no rlimits copied into containers, cgroupfs (no systemd), runc.
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
  export CONTAINERS_CONF=$STATE/containers.conf
}

if [ "$print_env" = 1 ]; then
  write_conf
  echo "export CONTAINERS_CONF=$CONTAINERS_CONF"
  exit 0
fi

[ "$(id -u)" -eq 0 ] || die "run as root: debootstrap, and rootful buildah/podman with runc (rootless needs subuids and fuse-overlayfs, untried here)"

ensure_tools() {
  local need=()
  command -v debootstrap >/dev/null || need+=(debootstrap)
  command -v buildah >/dev/null || need+=(buildah)
  command -v podman >/dev/null || need+=(podman)
  [ -x "$RUNTIME" ] || need+=(runc)
  # podman networks: netavark with aardvark-dns (container names resolve), iptables for its NAT rules.
  [ -x /usr/lib/podman/netavark ] || need+=(netavark)
  [ -x /usr/lib/podman/aardvark-dns ] || need+=(aardvark-dns)
  command -v iptables >/dev/null || need+=(iptables)
  [ ${#need[@]} -eq 0 ] && return
  command -v apt-get >/dev/null || die "missing ${need[*]}, and no apt-get to install them"
  say "installing ${need[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

build_base() {
  local rootfs=$STATE/rootfs t0=$SECONDS
  rm -rf "$rootfs" "$rootfs.partial"
  say "debootstrap bookworm (minbase + python3, python3-venv) from $MIRROR: a minute or two"
  mkdir -p "$STATE/debs"  # downloaded packages, kept: --rebuild downloads nothing again
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates --cache-dir="$STATE/debs" \
    bookworm "$rootfs.partial" "$MIRROR" > "$STATE/debootstrap.log" 2>&1 \
    || { tail -20 "$STATE/debootstrap.log" >&2; die "debootstrap failed (log: $STATE/debootstrap.log)"; }
  say "venv at /opt/venv (python and pip first on PATH), trimming apt lists and docs"
  chroot "$rootfs.partial" /usr/bin/python3 -m venv /opt/venv
  chroot "$rootfs.partial" /opt/venv/bin/pip --version >/dev/null
  # pip's own CA list (certifi) would ignore the system store, and with it any CA a build mounts.
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$rootfs.partial/etc/pip.conf"
  chroot "$rootfs.partial" apt-get clean
  rm -rf "$rootfs.partial"/var/lib/apt/lists/* "$rootfs.partial"/usr/share/{doc,man,info}/* \
    "$rootfs.partial"/var/cache/debconf/*-old "$rootfs.partial"/var/log/*.log
  mv "$rootfs.partial" "$rootfs"
  say "committing $BASE"
  local c
  c=$(buildah from scratch)
  buildah copy --quiet "$c" "$rootfs" / >/dev/null
  buildah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --env VIRTUAL_ENV=/opt/venv --cmd python \
    --label org.opencontainers.image.description="Debian bookworm, Python 3.11, venv /opt/venv" \
    --label "$LABEL=scripts/images.sh" \
    "$c"
  buildah commit --quiet --rm "$c" "$BASE" >/dev/null
  rm -rf "$rootfs"  # the image holds it now
  say "base image $BASE built in $((SECONDS - t0)) s"
}

build_image() {
  local dockerfile=$1 tag=$2 t0=$SECONDS
  if [ "$reuse" = 1 ] && buildah inspect --type image "$tag" >/dev/null 2>&1; then
    say "$tag present, reused (--reuse): it may predate the tree"
    return
  fi
  say "building $tag from $dockerfile (pip install . from PyPI when the tree changed: minutes)"
  local log=$STATE/build-${dockerfile#Dockerfile.}.log
  local ca=()
  [ -n "$CA_BUNDLE" ] && [ -f "$CA_BUNDLE" ] && ca=(--volume "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
  if ! buildah bud --layers --force-rm --runtime "$RUNTIME" --build-arg "PYTHON_IMAGE=$BASE" "${ca[@]}" \
      -f "$ROOT/$dockerfile" -t "$tag" "$ROOT" 2>&1 | tee "$log" | while IFS= read -r line; do
        case $line in STEP*|COMMIT*|"Successfully installed"*) say "  ${line:0:150}" ;; esac
      done; then
    tail -30 "$log" >&2
    die "buildah bud -f $dockerfile failed (log: $log)"
  fi
  say "$tag built in $((SECONDS - t0)) s"
}

write_conf
ensure_tools
if [ "$rebuild" = 1 ] || ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  build_base
else
  say "base image $BASE present (--rebuild to rebuild it)"
fi
[ "$base_only" = 1 ] && exit 0
build_image Dockerfile.syncer "$SYNCER"
build_image Dockerfile.learner "$LEARNER"
# Each rebuild leaves the previous images untagged (1.5 GB apiece): drop those of ours that no
# image uses any more; the layers of the current images stay, as buildah's cache.
podman --runtime "$RUNTIME" image prune --force --filter "label=$LABEL" >/dev/null
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^localhost/diloco/' | sed 's/^/  /'
