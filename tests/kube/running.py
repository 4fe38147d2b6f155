"""Run the operator (kopf) in a thread against the emulated cluster, and the cluster fixture parts.

kopf gets its own event loop (not pytest's), logs in through a kubeconfig that points at the
emulator (the same path `kubectl` and the operator's client use), and watches cluster-wide
(or the namespaces it is given) with namespace scanning off, as kmock requires (it serves no
namespace list) and the chart's RBAC grants.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import kopf
import yaml

from diloco.operator import handlers, peering
from diloco.operator.context import Config, Context
from diloco.operator.kube import Kube
from diloco.operator.peering import Peering
from tests.helpers import wait_for


def write_kubeconfig(path: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
    }))
    return path


class OperatorThread:
    """`with OperatorThread(config): ...` runs the operator until the block ends."""

    def __init__(self, config: Config, kube: Kube | None = None, namespaces: tuple[str, ...] = (),
                 peering: Peering | None = None, liveness_port: int | None = None):
        self.ctx = Context(config, kube=kube)
        self.namespaces = list(namespaces)  # () watches the whole cluster, as `diloco operator` without --namespace
        # None: standalone (kopf's --standalone); else peered as the chart's replicas run (main.py).
        self.peering = peering
        self.liveness_port = liveness_port  # kopf's /healthz, as the chart's probe reads it
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: list[BaseException] = []
        self.settings: kopf.OperatorSettings | None = None  # kopf's, once it runs
        self._thread = threading.Thread(target=self._run, name="kopf", daemon=True)

    def __enter__(self) -> OperatorThread:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"the operator did not become ready: {self._error}")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)
        if self._thread.is_alive():
            raise RuntimeError("the operator did not stop")
        if self._error and exc[0] is None:
            raise self._error[0]

    def kill(self) -> None:
        """Stop now, retrying nothing, without waiting (the block's end waits): with its network
        cut first (tests/realapi/link.py), a replica whose node died, its clean-up (kopf's
        removal of its peering record) never arriving and not retried for a minute."""
        if self.settings is not None:
            self.settings.networking.error_backoffs = ()
        self._stop.set()

    def reconciles(self, outcome: str = "ok") -> float:
        value = self.ctx.metrics.registry.get_sample_value("diloco_operator_reconciles_total", {"outcome": outcome})
        return value or 0.0

    def ticks(self, count: int = 2, outcome: str = "ok") -> None:
        """Wait for `count` more full reconciles with `outcome` (the status timer runs one per job
        each interval): after them, anything the operator was going to do has been done."""
        target = self.reconciles(outcome) + count
        wait_for(lambda: self.reconciles(outcome) >= target, timeout=30, what=f"{count} {outcome} reconciles")

    def _run(self) -> None:
        import asyncio

        settings = kopf.OperatorSettings()
        handlers.configure(settings)
        settings.watching.server_timeout = None
        settings.process.ultimate_exiting_timeout = 5.0
        self.settings = settings
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            peers: dict[str, Any] = {"standalone": True}
            if self.peering is not None:  # what main.py does for a peered replica
                peering.require(self.ctx.connect(), self.peering, self.namespaces)
                self.peering.apply(settings)
                peers = self.peering.run_kwargs()
            liveness = f"http://127.0.0.1:{self.liveness_port}/healthz" if self.liveness_port else None
            kopf.run(loop=loop, registry=handlers.build_registry(self.ctx.config), settings=settings,
                     memo=handlers.build_memo(self.ctx), clusterwide=not self.namespaces,
                     namespaces=self.namespaces, liveness_endpoint=liveness, **peers,
                     stop_flag=self._stop, ready_flag=self._ready)
        except BaseException as exc:
            self._error.append(exc)
            self._ready.set()
        finally:
            loop.close()
