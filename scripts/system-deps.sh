#!/usr/bin/env bash
# System packages the test suite uses beyond Python: Debian's prometheus (promtool and a real
# scrape in tests/system/test_prometheus.py) and iproute2 (ip, tc: the throttled-WAN test). Installed
# with apt-get when missing and we are root; otherwise say what is missing and carry on (those
# tests then skip outside CI and fail under CI).
set -euo pipefail
need=()
{ command -v prometheus && command -v promtool; } >/dev/null || need+=(prometheus)
{ command -v ip && command -v tc; } >/dev/null || need+=(iproute2)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${need[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
else
  echo "note: ${need[*]} missing; install them (Debian: apt-get install ${need[*]}) for the full suite" >&2
fi
