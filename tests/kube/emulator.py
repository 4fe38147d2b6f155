"""A Kubernetes API server for tests: kmock's emulator with the semantics kopf and we rely on.

kmock 0.8 stores and serves objects but (docs/DEVELOPMENT.md, "Kubernetes in tests") assigns no resourceVersion or uid, leaves
metadata.namespace empty, replays ADDED events after a list, and merges every PATCH. This
subclass adds what the operator depends on: resourceVersions (watches resume from the list's
version), uid/generation/creationTimestamp, generateName, label selectors, the status
subresource split, server-side apply that creates, no-op patches that change nothing, delete
and resourceVersion preconditions, a moment's outage (503s), and graceful pod deletion (Terminating until the kubelet or a force delete).
It runs on its own thread and event loop, so synchronous tests and kopf's thread can use it.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import secrets
import threading
import time
import uuid
import warnings
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import dicts  # the emulator's own merge/JSON patch functions

from diloco.operator import crd

PODS = kmock.resource("", "v1", "pods")
EVENT_LOG = 20_000  # watch events kept for resuming watches from a resourceVersion


def _now(offset: float = 0.0) -> str:
    t = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=offset)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    out: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            out.append(("!=", k.strip(), v.strip()))
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            out.append(("=", k.strip(), v.strip()))
        elif term.startswith("!"):
            out.append(("!", term[1:].strip(), None))
        else:
            out.append(("exists", term, None))
    return out


def _matches(obj: dict[str, Any], selector: list[tuple[str, str, str | None]]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for op, key, value in selector:
        if (op == "=" and labels.get(key) != value) or (op == "!=" and labels.get(key) == value) or \
                (op == "!" and key in labels) or (op == "exists" and key not in labels):
            return False
    return True


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


@attrs.define(kw_only=True)
class Cluster(kmock.KubernetesEmulator):
    _rv: int = attrs.field(default=0, init=False)
    _log: dict[Any, list[tuple[int, dict[str, Any]]]] = attrs.field(factory=dict, init=False)
    # Until this time.monotonic(), every request for an object answers 503, as a server that is
    # away a moment behind its load balancer (`ClusterThread.unavailable`); `refused` counts them
    # by User-Agent.
    away_until: float = attrs.field(default=0.0, init=False)
    refused: dict[str, int] = attrs.field(factory=dict, init=False)

    def register_builtin_and_crd(self) -> None:
        with warnings.catch_warnings():  # kmock 0.8 reads its bundle with a deprecated importlib call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()
        self.resources[f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}"] = kmock.ResourceInfo(
            kind="DecoupledDiLoCoJob", singular=crd.SINGULAR, namespaced=True, shortnames=set(crd.SHORT_NAMES),
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"}, subresources={"status"})
        # The Gateway API's GRPCRoute, as if its CRDs were installed (exposed syncers).
        self.resources["gateway.networking.k8s.io/v1/grpcroutes"] = kmock.ResourceInfo(
            kind="GRPCRoute", singular="grpcroute", namespaced=True,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"}, subresources={"status"})

    # -- writes -----------------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        writes = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
        if res is None or res.plural is None:
            return await super()._handle(request)  # discovery
        if time.monotonic() < self.away_until:
            agent = request.headers.get("User-Agent", "")
            self.refused[agent] = self.refused.get(agent, 0) + 1
            raise _error(503, "ServiceUnavailable", "the server is currently unable to handle the request")
        # Reads are served here directly: kmock's generic reaction matching costs ~50 ms a request.
        if request.action == kmock.action.LIST:
            return aiohttp.web.json_response(await self._serve_list(request))
        if request.action == kmock.action.WATCH:
            return await self._stream(request)
        if request.action == kmock.action.FETCH:
            async with self._lock:
                obj = self._live((res, request.namespace, request.name))
                if obj is None:
                    raise _error(404, "NotFound", f"{res.plural} {request.name!r} not found")
                return aiohttp.web.json_response(copy.deepcopy(obj.raw))
        if request.action not in writes:
            return await super()._handle(request)
        if request.action != kmock.action.CREATE and request.name is None:
            raise _error(405, "MethodNotAllowed", "collection writes are not emulated")
        async with self._lock:
            if request.action == kmock.action.CREATE:
                obj = await self._create(res, request.namespace, copy.deepcopy(request.data or {}))
            elif request.action == kmock.action.UPDATE:
                obj = await self._update(request)
            else:
                obj = await self._delete(request)
        return aiohttp.web.json_response(obj, status=201 if request.action == kmock.action.CREATE else 200)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    async def _emit(self, res: Any, kind: str, obj: dict[str, Any]) -> None:
        event = {"type": kind, "object": copy.deepcopy(obj)}
        log = self._log.setdefault(res, [])
        log.append((int(obj["metadata"]["resourceVersion"]), event))
        del log[:-EVENT_LOG]
        await self._buses[res].put(event)

    def _live(self, key: tuple[Any, str | None, str]) -> Any:
        return self._objects[key] if key in self._objects and not self._objects[key].deleted else None

    async def _create(self, res: Any, namespace: str | None, data: dict[str, Any]) -> dict[str, Any]:
        meta = data.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        key = (res, meta.get("namespace"), meta.get("name"))
        if not meta.get("name"):
            raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
        if self._live(key) is not None:
            raise _error(409, "AlreadyExists", f"{res.plural} {meta['name']!r} already exists")
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=_now(), generation=1)
        if key in self._objects:
            self._objects[key].create(data)
        else:
            self._objects[key] = data
        await self._emit(res, "ADDED", data)
        return data

    async def _update(self, request: kmock.Request) -> dict[str, Any]:
        res, sub = request.resource, request.subresource
        key = (res, request.namespace, request.name)
        ctype = request.headers.get("Content-Type", "")
        patch = request.data
        current_obj = self._live(key)
        if current_obj is None:
            if "apply-patch" in ctype and not sub:  # server-side apply creates
                return await self._create(res, request.namespace, copy.deepcopy(patch))
            raise _error(404, "NotFound", f"{res.plural} {request.name!r} not found")
        if sub not in (None, "status"):
            raise _error(404, "NotFound", f"subresource {sub!r} is not emulated")
        current = copy.deepcopy(current_obj.raw)
        has_status = "status" in self.resources[res].subresources
        try:
            if "apply-patch" in ctype:
                new = copy.deepcopy(current)
                for k, v in patch.items():
                    if k == "metadata":
                        for mk in ("labels", "annotations", "ownerReferences"):
                            if mk in v:
                                new["metadata"][mk] = v[mk]
                    elif k not in ("apiVersion", "kind", "status"):
                        new[k] = v
            elif isinstance(patch, list):
                new = dicts.patch_dict(current, patch)
            else:
                # A resourceVersion in the patch is a precondition on either half, as on a real
                # server: read before the status write drops the patch's metadata.
                expected = (patch.get("metadata") or {}).get("resourceVersion")
                if expected and expected != current["metadata"]["resourceVersion"]:
                    raise _error(409, "Conflict", "the object has been modified")
                if sub == "status":
                    patch = {"status": patch.get("status")}
                elif has_status:
                    patch = {k: v for k, v in patch.items() if k != "status"}
                new = dicts.patch_dict(current, patch)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise _error(422, "Invalid", str(exc)) from None
        new = copy.deepcopy(dict(new))
        if has_status and isinstance(patch, list):  # a JSON patch touches its own half only
            half = {k: v for k, v in new.items() if k != "status"} if sub != "status" else current
            status = new.get("status") if sub == "status" else current.get("status")
            new = {**{k: v for k, v in half.items() if k != "status"}, **({"status": status} if status else {})}
        for field in ("uid", "name", "namespace", "creationTimestamp", "resourceVersion", "generation"):
            if field in current["metadata"]:
                new["metadata"][field] = current["metadata"][field]
        if new == current:
            return current  # a no-op write changes nothing, as on a real API server
        new["metadata"]["resourceVersion"] = self._next_rv()
        if new.get("spec") != current.get("spec"):
            new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        current_obj.create(new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            return await self._remove(res, key, new)
        await self._emit(res, "MODIFIED", new)
        return new

    async def _delete(self, request: kmock.Request) -> dict[str, Any]:
        res = request.resource
        key = (res, request.namespace, request.name)
        obj = self._live(key)
        if obj is None:
            raise _error(404, "NotFound", f"{res.plural} {request.name!r} not found")
        current = copy.deepcopy(obj.raw)
        options = request.data if isinstance(request.data, dict) else {}
        want_uid = (options.get("preconditions") or {}).get("uid")
        if want_uid and want_uid != current["metadata"].get("uid"):
            raise _error(409, "Conflict", "precondition failed: uid does not match")
        grace_raw = request.params.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        grace = int(grace_raw) if grace_raw is not None else None
        meta = current["metadata"]
        is_pod = res == PODS
        if meta.get("deletionTimestamp") and not (is_pod and grace == 0):
            return current
        if meta.get("finalizers") or (is_pod and grace != 0 and not meta.get("deletionTimestamp")):
            if is_pod:  # Terminating until the kubelet confirms (or a force delete)
                grace = grace if grace is not None else (current.get("spec") or {}).get(
                    "terminationGracePeriodSeconds", 30)
                meta["deletionGracePeriodSeconds"] = grace
            meta["deletionTimestamp"] = _now(grace or 0) if is_pod else _now()
            meta["resourceVersion"] = self._next_rv()
            obj.create(current)
            await self._emit(res, "MODIFIED", current)
            return current
        return await self._remove(res, key, current)

    async def _remove(self, res: Any, key: Any, last: dict[str, Any]) -> dict[str, Any]:
        last["metadata"]["resourceVersion"] = self._next_rv()
        self._objects[key].create(last)
        self._objects[key].delete()
        await self._emit(res, "DELETED", last)
        return last

    # -- reads ------------------------------------------------------------------------------

    def _select(self, request: kmock.Request) -> list[dict[str, Any]]:
        selector = _parse_selector(request.params.get("labelSelector", ""))
        out = []
        for (res, namespace, _), obj in self._objects.items():
            if res == request.resource and not obj.deleted and \
                    (request.namespace is None or namespace == request.namespace) and _matches(obj.raw, selector):
                out.append(copy.deepcopy(obj.raw))
        return out

    async def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        if request.resource not in self._get_resources():
            raise _error(404, "NotFound", "the server could not find the requested resource")
        async with self._lock:
            return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": str(self._rv)},
                    "items": self._select(request)}

    async def _stream(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """Events after the given resourceVersion (or the current objects first), then live ones."""
        res = request.resource
        since = request.params.get("resourceVersion")
        selector = _parse_selector(request.params.get("labelSelector", ""))

        def wanted(event: dict[str, Any]) -> bool:
            meta = event["object"].get("metadata") or {}
            return (request.namespace is None or meta.get("namespace") == request.namespace) and \
                _matches(event["object"], selector)

        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        async with self._lock:
            marker = await self._buses[res].mark()
            if since not in (None, "", "0"):
                backlog = [e for rv, e in self._log.get(res, []) if rv > int(since)]
            else:
                backlog = [{"type": "ADDED", "object": o} for o in self._select(request)]
            last = self._rv
        try:
            for event in backlog:
                if wanted(event):
                    await response.write(json.dumps(event).encode() + b"\n")
            async for event in self._buses[res].stream(since=marker):
                if int(event["object"]["metadata"]["resourceVersion"]) > last and wanted(event):
                    await response.write(json.dumps(event).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            await self._buses[res].unmark(marker)
        return response


class ClusterThread:
    """The emulated API server on its own loop and thread; `url` is where clients connect."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)

    def __enter__(self) -> ClusterThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the emulated API server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with Cluster() as cluster, kmock.Server(cluster) as server:
            cluster.register_builtin_and_crd()
            self.cluster = cluster
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def unavailable(self, seconds: float) -> None:
        """Every request for an object answers 503 for `seconds` from now."""
        assert self.cluster is not None
        self.cluster.away_until = time.monotonic() + seconds

    def writes(self, agent: str | None = None, plurals: set[str] | None = None) -> list[Any]:
        """Requests that changed (or tried to change) objects, by client and resource."""
        assert self.cluster is not None
        return [r for r in list(self.cluster)
                if r.method in ("POST", "PUT", "PATCH", "DELETE") and r.resource is not None
                and (agent is None or r.headers.get("User-Agent") == agent)
                and (plurals is None or r.resource.plural in plurals)]
