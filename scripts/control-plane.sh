#!/usr/bin/env bash
# Build a real Kubernetes 1.20 control plane from Debian bookworm's own sources, once per machine.
#
#   scripts/control-plane.sh build     # -> $KUBE_CACHE/bin/{etcd,kube-apiserver,kube-controller-manager,kube-scheduler}
#   scripts/control-plane.sh path      # prints the bin folder (builds first if needed)
#   scripts/control-plane.sh build-node  # -> $KUBE_CACHE/node/{kubelet,kube-proxy} (a real node, make test-cluster)
#   scripts/control-plane.sh node-path   # prints the node's bin folder (builds first if needed)
#
# Why from source: no registry or release host is reachable from our machines, only Debian's apt.
# Debian bookworm ships the `kubernetes` source package (1.20.2 with its vendor/ tree), Go 1.19
# and etcd 3.4; nothing is installed system-wide: packages are downloaded with apt's ordinary
# client under a private apt state and unpacked with dpkg-deb. The build takes ~10 minutes of two
# cores and ~3 GB of disk; the binaries (~250 MB) are cached under $KUBE_CACHE and the tree is
# removed afterwards. Two fixes make the 1.20 tree build with Go 1.19 (see ../shared/SPEC.md §5):
# Debian's reflect2 1.0.2 replaces the vendored 1.0.1, and an `rsync` shim when none is installed.
# The node's binaries come from the same tree, fetched again (the tree is not kept) and cached in
# their own folder, so building them never touches the control plane's cache (and vice versa).
set -euo pipefail

CACHE="${KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/decoupled-diloco/kube-1.20}"
BIN="$CACHE/bin"
WANT=(etcd kube-apiserver kube-controller-manager kube-scheduler)
NODE_BIN="$CACHE/node"
NODE_WANT=(kubelet kube-proxy)

built() {
  for b in "${WANT[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
}

node_built() {
  for b in "${NODE_WANT[@]}"; do [[ -x "$NODE_BIN/$b" ]] || return 1; done
}

say() { echo "control-plane: $*" >&2; }

# One build at a time per cache: two test processes (or `make test` beside a test run by hand)
# asking for a missing binary would otherwise fetch into the same work folder, each removing the
# other's tree. The second waits here, then finds the binaries built.
lock() {
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.build.lock"
  if ! flock -n 9; then
    say "another build is running (lock $CACHE/.build.lock); waiting for it"
    flock 9
  fi
}

# Downloads and unpacks the patched tree, Go and etcd into $1 (a fresh folder).
fetch() {
  local work="$1"
  rm -rf "$work"
  mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/src" "$work/root" "$work/shim"
  # A private apt state: the machine's own bookworm mirror, plus the deb-src line apt-get source needs.
  local mirror
  mirror="$( (cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true) \
            | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+' | grep -v security | grep '/debian' | head -n1 || true)"
  mirror="${mirror:-http://deb.debian.org/debian}"
  printf 'deb %s bookworm main\ndeb-src %s bookworm main\n' "$mirror" "$mirror" > "$work/sources.list"
  local apt=(apt-get -q -o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=-"
             -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives"
             -o "APT::Sandbox::User=root")
  say "apt metadata from $mirror"
  "${apt[@]}" update >/dev/null
  say "downloading the kubernetes source package, Go 1.19, reflect2 and etcd"
  (cd "$work/src" && "${apt[@]}" source --download-only kubernetes >/dev/null)
  (cd "$work" && "${apt[@]}" download golang-1.19-go golang-1.19-src \
      golang-github-modern-go-reflect2-dev etcd-server >/dev/null)
  for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
  (cd "$work/src" && dpkg-source --no-check -x ./*.dsc tree >/dev/null)
  local tree="$work/src/tree"
  local reflect2="$work/root/usr/share/gocode/src/github.com/modern-go/reflect2"
  [[ -d "$reflect2" ]] || { say "reflect2 sources not found in golang-github-modern-go-reflect2-dev"; exit 1; }
  rm -rf "$tree/vendor/github.com/modern-go/reflect2"
  cp -r "$reflect2" "$tree/vendor/github.com/modern-go/reflect2"
  if ! command -v rsync >/dev/null; then
    # The build scripts only call `rsync -pc FILE DIR`; cp -p does the same job.
    printf '#!/bin/sh\nshift\nexec cp -p "$@"\n' > "$work/shim/rsync"
    chmod +x "$work/shim/rsync"
  fi
}

build() {
  built && { say "cached in $BIN"; return 0; }
  lock
  if built; then
    say "cached in $BIN"
    return 0
  fi
  local work="$CACHE/work"
  fetch "$work"
  mkdir -p "$BIN"
  local tree="$work/src/tree"
  local goroot="$work/root/usr/lib/go-1.19"
  say "building kube-apiserver, kube-controller-manager and kube-scheduler (about 10 minutes)"
  (cd "$tree" && env PATH="$goroot/bin:$work/shim:$PATH" GOROOT="$goroot" GOPATH="$work/gopath" \
      GOCACHE="$work/gocache" GOPROXY=off GOFLAGS=-p=2 CGO_ENABLED=0 \
      make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler" > "$work/build.log" 2>&1) || {
    tail -n 40 "$work/build.log" >&2
    say "build failed; the full log is $work/build.log"
    exit 1
  }
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    cp "$(find "$tree/_output" -type f -name "$b" -perm -u+x | head -n1)" "$BIN/$b"
  done
  cp "$work/root/usr/bin/etcd" "$BIN/etcd"
  built || { say "a binary is missing from $BIN"; exit 1; }
  rm -rf "$work"
  say "built into $BIN"
}

# The kubelet and kube-proxy of the same tree, for a real node (tests/cluster/test_cluster.py). Its own
# work folder and cache: the control plane's binaries are neither needed nor rebuilt. About the
# same time as the control plane; KUBE_NODE_GOFLAGS (default -p=1) leaves a core to others.
build_node() {
  node_built && { say "node cached in $NODE_BIN"; return 0; }
  lock
  if node_built; then
    say "node cached in $NODE_BIN"
    return 0
  fi
  local work="$CACHE/work-node"
  fetch "$work"
  mkdir -p "$NODE_BIN"
  local tree="$work/src/tree"
  local goroot="$work/root/usr/lib/go-1.19"
  say "building kubelet and kube-proxy (about 10 minutes)"
  (cd "$tree" && env PATH="$goroot/bin:$work/shim:$PATH" GOROOT="$goroot" GOPATH="$work/gopath" \
      GOCACHE="$work/gocache" GOPROXY=off GOFLAGS="${KUBE_NODE_GOFLAGS:--p=1}" CGO_ENABLED=0 \
      make WHAT="cmd/kubelet cmd/kube-proxy" > "$work/build.log" 2>&1) || {
    tail -n 40 "$work/build.log" >&2
    say "build failed; the full log is $work/build.log"
    exit 1
  }
  for b in "${NODE_WANT[@]}"; do
    cp "$(find "$tree/_output" -type f -name "$b" -perm -u+x | head -n1)" "$NODE_BIN/$b"
  done
  node_built || { say "a binary is missing from $NODE_BIN"; exit 1; }
  rm -rf "$work"
  say "built into $NODE_BIN"
}

case "${1:-build}" in
  build) build ;;
  # Not `build && echo`: bash turns errexit off inside a function called left of &&, so a failed
  # download went on to build nothing.
  path) build; echo "$BIN" ;;
  build-node) build_node ;;
  node-path) build_node; echo "$NODE_BIN" ;;
  *) echo "usage: $0 build|path|build-node|node-path" >&2; exit 2 ;;
esac
