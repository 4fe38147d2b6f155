"""A real, rate-limited WAN on one machine: network namespaces, veth pairs and `tbf`.

A "home" namespace hosts the syncer; each region gets its own namespace joined to home by
a veth pair whose two ends are shaped with the token-bucket filter (one direction each),
so every byte between a region and home crosses a link of the chosen rate. Needs root and
iproute2 (`ip`, `tc`); `netem` is not available here, so there is no added latency.

Everything is named with a per-process prefix and removed on exit, on error and, for
leftovers of a killed run, by `sweep_stale()`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFIX = "ddwan"


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _run(*argv: str) -> None:
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")


def sweep_stale() -> None:
    """Delete namespaces left by runs whose process is gone."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in re.findall(rf"^({PREFIX}(\d+)-\S+)", out, flags=re.M):
        ns, pid = name
        if not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@dataclass
class Link:
    region: str
    namespace: str
    home_ip: str  # the syncer's address as seen from this region
    region_ip: str
    home_dev: str
    region_dev: str


@dataclass
class Wan:
    """Context manager: `with Wan(["us", "eu"], mbit=20) as wan: wan.exec("us", argv)`."""

    regions: Sequence[str]
    mbit: float | None = None  # None: unshaped veth
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    links: dict[str, Link] = field(default_factory=dict)

    @property
    def home(self) -> str:
        return f"{self.tag}-home"

    def __enter__(self) -> Wan:
        sweep_stale()
        try:
            _run("ip", "netns", "add", self.home)
            _run("ip", "-n", self.home, "link", "set", "lo", "up")
            for i, region in enumerate(self.regions, start=1):
                self._add_region(i, region)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_region(self, i: int, region: str) -> None:
        ns = f"{self.tag}-r{i}"
        link = Link(region, ns, f"10.77.{i}.1", f"10.77.{i}.2", f"{self.tag[-6:]}h{i}", f"{self.tag[-6:]}r{i}")
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", link.home_dev, "type", "veth", "peer", "name", link.region_dev)
        _run("ip", "link", "set", link.home_dev, "netns", self.home)
        _run("ip", "link", "set", link.region_dev, "netns", ns)
        _run("ip", "-n", self.home, "addr", "add", f"{link.home_ip}/24", "dev", link.home_dev)
        _run("ip", "-n", ns, "addr", "add", f"{link.region_ip}/24", "dev", link.region_dev)
        _run("ip", "-n", self.home, "link", "set", link.home_dev, "up")
        _run("ip", "-n", ns, "link", "set", link.region_dev, "up")
        self.links[region] = link
        if self.mbit is not None:
            self.set_rate(region, self.mbit)

    def set_rate(self, region: str, mbit: float) -> None:
        """Shape both directions of a region's link to `mbit` (tbf on each end's egress). A link
        already shaped is changed in place (`replace`): the packets queued in it are kept."""
        link = self.links[region]
        burst = max(16_000, int(mbit * 1e6 / 8 / 100))  # ~10 ms of traffic, at least 16 kB
        for ns, dev in ((self.home, link.home_dev), (link.namespace, link.region_dev)):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", str(burst), "latency", "500ms")

    def unshape(self, region: str) -> None:
        """A region's link unshaped again, both ways."""
        link = self.links[region]
        for ns, dev in ((self.home, link.home_dev), (link.namespace, link.region_dev)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def argv(self, where: str, argv: Sequence[str]) -> list[str]:
        """Run argv inside the home namespace (`where="home"`) or a region's."""
        ns = self.home if where == "home" else self.links[where].namespace
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        for link in self.links.values():
            subprocess.run(["ip", "netns", "del", link.namespace], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.home], capture_output=True)
        self.links.clear()
