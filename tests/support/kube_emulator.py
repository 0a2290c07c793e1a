"""A stateful Kubernetes API emulator for nodes and pods, strict where gpud's protocol relies on it.

kmock (PyPI) serves Kubernetes-shaped HTTP on 127.0.0.1 and parses requests into actions, which
the real client (lightkube) talks to unchanged; but its own KubernetesEmulator keeps no
resourceVersion, ignores selectors and never answers 409. This subclass keeps kmock's server,
parsing and rendering and replaces the object store with the API server's semantics gpud needs:

* every write bumps one cluster-wide resourceVersion, stamped on the object and its watch event;
* a PATCH (JSON merge patch, RFC 7386; strategic merge acts the same on labels) whose body carries
  metadata.resourceVersion other than the stored one fails 409 Conflict, as the real server does
  (optimistic concurrency); a JSON patch (RFC 6902) is refused 415;
* list and watch honour labelSelector (=, ==, !=, key, !key) and fieldSelector (metadata.name,
  metadata.namespace, spec.nodeName);
* a watch from resourceVersion N replays the events after N, then streams; one from a version
  older than the retained history gets an ERROR event 410 Gone; timeoutSeconds ends the stream
  (clients reconnect from the last version they saw);
* `before_write` lets a test act as another client at an exact point (a concurrent writer).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock import KubernetesEmulator, KubernetesError, KubernetesObjectNotFoundError

KINDS = {"nodes": "Node", "pods": "Pod", "events": "Event"}
NAMESPACED = ("pods", "events")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _field(obj: dict, path: str) -> str | None:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur if isinstance(cur, str) else None


def _selector_terms(text: str | None) -> list[tuple[str, str, str | None]]:
    terms: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in (text or "").split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            terms.append((k.strip(), "!=", v.strip()))
        elif "==" in term or "=" in term:
            k, v = term.split("==", 1) if "==" in term else term.split("=", 1)
            terms.append((k.strip(), "=", v.strip()))
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "!", None))
        else:
            terms.append((term, "exists", None))
    return terms


def matches(obj: dict, labels: str | None, fields: str | None) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    for k, op, v in _selector_terms(labels):
        if (op == "=" and have.get(k) != v) or (op == "!=" and have.get(k) == v) \
                or (op == "!" and k in have) or (op == "exists" and k not in have):
            return False
    for k, op, v in _selector_terms(fields):
        if k not in ("metadata.name", "metadata.namespace", "spec.nodeName"):
            raise KubernetesError(status=400, reason="BadRequest",
                                  message=f'field label not supported: {k}')
        got = _field(obj, k) or ""
        if (op == "=" and got != v) or (op == "!=" and got == v):
            return False
    return True


@attrs.define(kw_only=True)
class ApiServer(KubernetesEmulator):
    history: int = 1000  # watch events retained; older versions get 410 Gone
    before_write: Callable[[str, str, str, Any], Awaitable[None] | None] | None = None

    _store: dict[tuple[str, str | None, str], dict] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=1, init=False)
    _log: list[tuple[int, str, str, dict]] = attrs.field(factory=list, init=False)
    _compacted: int = attrs.field(default=0, init=False)
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)
    _stopping: bool = attrs.field(default=False, init=False)
    _generation: int = attrs.field(default=0, init=False)
    _gate: asyncio.Event | None = attrs.field(default=None, init=False)
    gone: int = attrs.field(default=0, init=False)  # watches answered 410 Gone
    conflicts: list[dict] = attrs.field(factory=list, init=False)  # bodies refused with 409
    writes: list[tuple[int, str, str, str, Any]] = attrs.field(factory=list, init=False)  # (rv, verb, plural, name, body)

    # --- kmock plumbing: our store, not kmock's ----------------------------------------------
    async def _handle(self, request):  # skip KubernetesEmulator's own object tracking
        return await kmock.RawHandler._handle(self, request)

    async def _render_error(self, exc):
        """A Status object with the content type the API server sends (exactly application/json:
        clients such as lightkube only decode a Status under that header)."""
        if not isinstance(exc, KubernetesError):
            return await super()._render_error(exc)
        status = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": exc.status,
                  "reason": exc.reason or type(exc).__name__, "message": exc.message or repr(exc),
                  "details": exc.details or {}}
        return aiohttp.web.Response(status=exc.status, body=json.dumps(status).encode(),
                                    headers={"Content-Type": "application/json"})

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _key(self, request, name: str | None = None) -> tuple[str, str | None, str]:
        plural = request.resource.plural
        if plural not in KINDS:
            raise KubernetesError(status=404, reason="NotFound", message=f"the server could not find {plural}")
        return plural, request.namespace if plural in NAMESPACED else None, name or request.name

    async def _commit(self, verb: str, key, obj: dict | None, body: Any, event: str) -> dict:
        self._rv += 1
        plural, _, name = key
        if obj is not None:
            obj["metadata"]["resourceVersion"] = str(self._rv)
            self._store[key] = obj
            logged = copy.deepcopy(obj)
        else:
            logged = copy.deepcopy(self._store.pop(key))
            logged["metadata"]["resourceVersion"] = str(self._rv)
        self.writes.append((self._rv, verb, plural, name, copy.deepcopy(body)))
        self._log.append((self._rv, plural, event, logged))
        if len(self._log) > self.history:
            dropped = self._log[: len(self._log) - self.history]
            self._compacted = dropped[-1][0]
            del self._log[: len(dropped)]
        async with self._cond():
            self._cond().notify_all()
        return logged

    async def _before(self, verb, plural, name, body):
        if self.before_write is not None:
            result = self.before_write(verb, plural, name, body)
            if asyncio.iscoroutine(result):
                await result

    # --- helpers for tests (act as another client, bypassing HTTP) ---------------------------
    def _watch_gate(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()
            self._gate.set()
        return self._gate

    async def interrupt_watches(self) -> None:
        """End the open watch streams and hold new ones until resume_watches(), as a network cut or
        an API server restart does: clients come back with the last version they saw."""
        self._watch_gate().clear()
        self._generation += 1
        async with self._cond():
            self._cond().notify_all()

    def resume_watches(self) -> None:
        self._watch_gate().set()

    async def end_watches(self) -> None:
        """End every open watch stream (as an API server does on shutdown), so the HTTP server can
        stop without waiting for clients that went away."""
        self._stopping = True
        async with self._cond():
            self._cond().notify_all()

    @property
    def resource_version(self) -> int:
        return self._rv

    def get(self, plural: str, name: str, namespace: str | None = None) -> dict | None:  # type: ignore[override]  # the store, not kmock's HTTP GET handler
        obj = self._store.get((plural, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def put_object(self, plural: str, obj: dict) -> dict:
        """Create or merge an object as a controller would (a write with its own version)."""
        meta = obj.setdefault("metadata", {})
        key = (plural, meta.get("namespace") if plural in NAMESPACED else None, meta["name"])
        old = self._store.get(key)
        if old is None:
            new = self._new(plural, obj, meta.get("namespace"))
            return await self._commit("create", key, new, obj, "ADDED")
        return await self._commit("patch", key, merge_patch(old, obj), obj, "MODIFIED")

    async def remove_object(self, plural: str, name: str, namespace: str | None = None) -> None:
        await self._commit("delete", (plural, namespace, name), None, None, "DELETED")

    def node_history(self, name: str) -> list[dict[str, str]]:
        """Every label set the node has had, in order (from the watch log, so keep `history` big)."""
        return [copy.deepcopy(o["metadata"].get("labels") or {}) for _, p, _, o in self._log
                if p == "nodes" and o["metadata"]["name"] == name]

    def _new(self, plural: str, obj: dict, namespace: str | None) -> dict:
        new = copy.deepcopy(obj)
        meta = new.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        if plural in NAMESPACED:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        new.setdefault("apiVersion", "v1")
        new["kind"] = KINDS[plural]
        return new

    # --- the verbs ---------------------------------------------------------------------------
    async def _serve_fetch(self, request):
        obj = self._store.get(self._key(request))
        if obj is None:
            raise KubernetesObjectNotFoundError()
        return copy.deepcopy(obj)

    async def _serve_list(self, request):
        plural = request.resource.plural
        items = [copy.deepcopy(o) for (p, ns, _), o in sorted(self._store.items(), key=lambda kv: str(kv[0]))
                 if p == plural and (request.namespace is None or ns == request.namespace)
                 and matches(o, request.params.get("labelSelector"), request.params.get("fieldSelector"))]
        return {"apiVersion": "v1", "kind": KINDS.get(plural, "") + "List",
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    async def _serve_create(self, request):
        body = request.data or {}
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):  # the server completes the name
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = self._key(request, meta.get("name"))
        await self._before("create", key[0], key[2], body)
        if key in self._store:
            raise KubernetesError(status=409, reason="AlreadyExists",
                                  message=f'{key[0]} "{key[2]}" already exists')
        return await self._commit("create", key, self._new(key[0], body, request.namespace), body, "ADDED")

    async def _serve_update(self, request):
        key = self._key(request)
        body = request.data
        await self._before("patch", key[0], key[2], body)
        old = self._store.get(key)
        if old is None:
            raise KubernetesObjectNotFoundError()
        ctype = (request.headers.get("Content-Type") or request.headers.get("content-type") or "").split(";")[0]
        if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            raise KubernetesError(status=415, reason="UnsupportedMediaType",
                                  message=f"patch type {ctype!r} is not supported by this emulator")
        want = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
        if want is not None and want != old["metadata"]["resourceVersion"]:
            self.conflicts.append(copy.deepcopy(body))
            raise KubernetesError(
                status=409, reason="Conflict", details={"name": key[2], "kind": key[0]},
                message=f'Operation cannot be fulfilled on {key[0]} "{key[2]}": the object has been modified; '
                        "please apply your changes to the latest version and try again")
        new = merge_patch(old, body)
        new["metadata"]["name"], new["metadata"]["uid"] = old["metadata"]["name"], old["metadata"]["uid"]
        return await self._commit("patch", key, new, body, "MODIFIED")

    async def _serve_delete(self, request):
        key = self._key(request)
        await self._before("delete", key[0], key[2], None)
        if key not in self._store:
            raise KubernetesObjectNotFoundError()
        return await self._commit("delete", key, None, None, "DELETED")

    async def _serve_watch(self, request):
        yield b""  # headers out: the client sees a stream even before any event
        await self._watch_gate().wait()
        generation = self._generation
        plural = request.resource.plural
        labels, fields = request.params.get("labelSelector"), request.params.get("fieldSelector")
        timeout = float(request.params["timeoutSeconds"]) if request.params.get("timeoutSeconds") else None
        deadline = asyncio.get_running_loop().time() + timeout if timeout else None

        def wanted(p, o):
            return p == plural and (request.namespace is None or o["metadata"].get("namespace") == request.namespace) \
                and matches(o, labels, fields)

        since = request.params.get("resourceVersion")
        if since in (None, "", "0"):
            last = self._rv
            for (p, _, _), o in sorted(self._store.items(), key=lambda kv: str(kv[0])):
                if wanted(p, o):
                    yield {"type": "ADDED", "object": copy.deepcopy(o)}
        else:
            last = int(since)
            if last < self._compacted:
                self.gone += 1
                yield {"type": "ERROR", "object": {
                    "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 410, "reason": "Expired",
                    "message": f"too old resource version: {last} ({self._compacted})", "metadata": {}}}
                return
        while not self._stopping and generation == self._generation:
            if last < self._compacted:  # fell behind the retained history while streaming
                self.gone += 1
                yield {"type": "ERROR", "object": {
                    "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 410, "reason": "Expired",
                    "message": f"too old resource version: {last} ({self._compacted})", "metadata": {}}}
                return
            for rv, p, event, o in list(self._log):
                if rv > last:
                    last = rv
                    if wanted(p, o):
                        yield {"type": event, "object": copy.deepcopy(o)}
            async with self._cond():
                if any(rv > last for rv, *_ in self._log) or self._stopping or generation != self._generation:
                    continue
                try:
                    remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
                    if remaining is not None and remaining <= 0:
                        return
                    await asyncio.wait_for(self._cond().wait(), remaining)
                except TimeoutError:
                    return
