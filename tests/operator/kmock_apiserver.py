"""kmock's KubernetesEmulator, grown into enough of an API server to run kopf operators on.

kmock 0.8's emulator stores objects and streams changes, but it is not an API server:
no uid/resourceVersion/generation, JSON-patch applied as a merge, watches that miss
events between listing and subscribing, no label selectors, no status/scale subresources,
no garbage collector. This subclass adds exactly those, so the real kopf operator (and
issue 7's end-to-end harness) can run against it:

    async with KubeAPIServer() as api, kmock.Server(api) as server:
        kubeconfig = write_kubeconfig(tmp_path, server.url)

Not modelled: admission (schema validation, defaulting), field selectors, PUT, resource
quotas, the scheduler and the kubelet (tests play the kubelet by patching pod status).
"""

from __future__ import annotations

import copy
import datetime
import json
import pathlib
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
import kmock
import yaml
from kmock._internal import apps, enums, k8s, parsing, references, rendering

CRD_DIR = pathlib.Path(__file__).resolve().parents[2] / "crds"
CRD_PATH = CRD_DIR / "inferenceservices.yaml"
PEERING_CRDS_PATH = CRD_DIR / "kopf-peerings.yaml"  # kopf.dev: for operators with --peering


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unprocessable(message: str) -> k8s.KubernetesError:
    return k8s.KubernetesError(status=422, reason="Invalid", message=message)


# kmock 0.8 reads /api/v1/namespaces[/NAME] as "namespace NAME, no resource" (and fails on
# the bare list), while kopf lists and watches namespaces in namespaced mode.
_parse_path = parsing.parse_path


def _parse_path_with_namespaces(path: str) -> parsing.ParsedPath:
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) in (3, 4):
        return parsing.ParsedPath("", "v1", "namespaces", None,
                                  parts[3] if len(parts) == 4 else None, None)
    return _parse_path(path)


parsing.parse_path = _parse_path_with_namespaces


# --- patch semantics ---------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: dicts merge, null deletes, anything else (lists too) replaces."""
    return _merge(target, patch, None, {})


# Lists that a strategic merge patch merges by key instead of replacing (the ones the
# operator and kubelet-playing tests write; the real server knows them all from the schema).
_MERGE_KEYS = {"conditions": "type", "containers": "name", "volumes": "name", "env": "name"}


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A JSON merge patch, except that the lists in _MERGE_KEYS merge item by item on their key."""
    return _merge(target, patch, None, _MERGE_KEYS)


def _merge(target: Any, patch: Any, field: str | None, merge_keys: dict[str, str]) -> Any:
    if isinstance(patch, list) and field in merge_keys and isinstance(target, list):
        key = merge_keys[field]
        out = [copy.deepcopy(x) for x in target]
        for item in patch:
            for i, existing in enumerate(out):
                if isinstance(existing, dict) and existing.get(key) == item.get(key):
                    out[i] = _merge(existing, item, None, merge_keys)
                    break
            else:
                out.append(copy.deepcopy(item))
        return out
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v, k, merge_keys)
    return out


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 (add, remove, replace, test); a failed test or bad path is a 422."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = _pointer(op["path"])
        parent = doc
        for p in parts[:-1]:
            try:
                parent = parent[int(p)] if isinstance(parent, list) else parent[p]
            except (KeyError, IndexError, ValueError) as e:
                raise _unprocessable(f"path {op['path']!r} not found") from e
        last = parts[-1] if parts else None
        kind = op["op"]
        if kind == "test":
            try:
                current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            except (IndexError, ValueError):
                current = None
            if current != op.get("value"):
                raise _unprocessable(f"test failed at {op['path']}: {current!r} != {op.get('value')!r}")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                if kind == "replace" and last not in parent:
                    raise _unprocessable(f"path {op['path']!r} not found")
                parent[last] = op["value"]
        elif kind == "remove":
            try:
                del parent[int(last) if isinstance(parent, list) else last]
            except (KeyError, IndexError, ValueError) as e:
                raise _unprocessable(f"path {op['path']!r} not found") from e
        else:
            raise _unprocessable(f"unsupported op {kind!r}")
    return doc


def labels_match(obj: dict[str, Any], selector: str | None) -> bool:
    """Equality-based selectors (a=b, a!=b, a, !a), comma-separated."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def write_kubeconfig(directory: pathlib.Path, url: Any) -> pathlib.Path:
    """A kubeconfig pointing at the emulator, for kopf's login and for our client."""
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "kmock"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock",
                                                   "namespace": "default"}}],
    }))
    return path


# --- the server --------------------------------------------------------------------------

@attrs.define(kw_only=True)
class KubeAPIServer(kmock.KubernetesEmulator):
    crds: tuple[pathlib.Path, ...] = (CRD_PATH, PEERING_CRDS_PATH)
    _rv: int = attrs.field(default=0, init=False)
    _created: dict[int, dict[str, Any]] = attrs.field(factory=dict, init=False)
    # Every change, in order: a watch from a resourceVersion replays what came after it.
    _log: list[tuple[Any, dict[str, Any]]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        for path in self.crds:
            for crd in yaml.safe_load_all(path.read_text()):
                self.declare_crd(crd)
        # Every cluster has these.
        for ns in ("default", "kube-system"):
            self._rv += 1
            self._objects[kmock.resource("v1", "namespaces"), None, ns] = {
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": ns, "uid": str(uuid.uuid4()),
                             "resourceVersion": str(self._rv), "creationTimestamp": _now()}}

    def declare_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            info = self.resources[f"{spec['group']}/{version['name']}/{spec['names']['plural']}"]
            info.kind = spec["names"]["kind"]
            info.singular = spec["names"].get("singular")
            info.namespaced = spec["scope"] == "Namespaced"
            info.shortnames = set(spec["names"].get("shortNames", []))
            info.categories = set(spec["names"].get("categories", []))
            info.verbs = {"get", "list", "watch", "create", "update", "patch", "delete",
                          "deletecollection"}
            info.subresources = set(version.get("subresources", {}))

    # -- helpers --

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _has_status(self, resource: references.resource) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _live(self, key: Any) -> Any:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key]

    async def _store(self, key: Any, body: dict[str, Any], event: str) -> None:
        obj = self._objects[key]
        obj.history.append(body)
        self._log.append((key[0], {"type": event, "object": copy.deepcopy(body)}))
        await self._buses[key[0]].put({"type": event, "object": copy.deepcopy(body)})

    async def _remove(self, key: Any) -> None:
        obj = self._objects[key]
        body = copy.deepcopy(obj.raw)
        body["metadata"]["resourceVersion"] = self._next_rv()
        obj.history.append(body)
        obj.delete()
        self._log.append((key[0], {"type": "DELETED", "object": copy.deepcopy(body)}))
        await self._buses[key[0]].put({"type": "DELETED", "object": body})
        await self._collect_garbage(body["metadata"].get("uid"))

    async def _collect_garbage(self, owner_uid: str | None) -> None:
        """Cascade: delete every object owned by the removed one (foreground not modelled)."""
        if not owner_uid:
            return
        for key, obj in list(self._objects.items()):
            if obj.deleted:
                continue
            refs = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
            if any(r.get("uid") == owner_uid for r in refs):
                await self._delete(key)

    async def _delete(self, key: Any) -> None:
        obj = self._objects[key]
        meta = obj.raw.get("metadata") or {}
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                body = copy.deepcopy(obj.raw)
                body["metadata"]["deletionTimestamp"] = _now()
                body["metadata"]["resourceVersion"] = self._next_rv()
                await self._store(key, body, "MODIFIED")
        else:
            await self._remove(key)

    # -- request handling: all state changes happen here, then kmock renders --

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is not None:
            async with self._lock:
                if request.action == enums.action.CREATE:
                    self._created[id(request)] = await self._create(request)
                elif request.action == enums.action.UPDATE and request.name is not None:
                    await self._patch(request)
                elif request.action == enums.action.DELETE and request.name is not None:
                    key = (request.resource, request.namespace, request.name)
                    if self._live(key) is None:
                        raise k8s.KubernetesObjectNotFoundError()
                    await self._delete(key)
        # Skip KubernetesEmulator._handle (its own, simpler state changes): render only.
        return await apps.RawHandler._handle(self, request)

    async def _create(self, request: rendering.Request) -> dict[str, Any]:
        if request.resource not in self.resources:
            raise k8s.KubernetesResourceNotFoundError()
        body = copy.deepcopy(request.data or {})
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if request.namespace:
            meta["namespace"] = request.namespace
        key = (request.resource, meta.get("namespace"), meta["name"])
        if self._live(key) is not None:
            raise k8s.KubernetesObjectConflictError()
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(),
                    creationTimestamp=_now(), generation=1)
        if request.resource == kmock.resource("v1", "pods"):
            body.setdefault("status", {"phase": "Pending"})
        if key not in self._objects:
            self._objects[key] = {}
            self._objects[key].history.clear()
        await self._store(key, body, "ADDED")
        return copy.deepcopy(body)

    async def _patch(self, request: rendering.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        obj = self._live(key)
        if obj is None:
            raise k8s.KubernetesObjectNotFoundError()
        current = copy.deepcopy(obj.raw)
        ctype = (request.headers.get("Content-Type") or "").split(";")[0]
        data = request.data if request.data is not None else json.loads(request.text or "null")
        sub = request.subresource
        if sub == "scale":
            # The patch is against a Scale object; only spec.replicas maps back.
            scale = merge_patch(self._scale(current), data)
            new = copy.deepcopy(current)
            new.setdefault("spec", {})["replicas"] = scale["spec"]["replicas"]
        else:
            if ctype == "application/json-patch+json":
                new = json_patch(current, data)
            elif ctype == "application/strategic-merge-patch+json":
                new = strategic_merge_patch(current, data)
            else:
                new = merge_patch(current, data)
            if sub == "status":
                new = {**current, "status": new.get("status")}
            elif self._has_status(request.resource):
                new["status"] = current.get("status")  # the main endpoint ignores status
            if new.get("status") is None:
                new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for fixed in ("uid", "name", "namespace", "creationTimestamp"):
            if fixed in current.get("metadata", {}):
                meta[fixed] = current["metadata"][fixed]
        # Like the API server: a deletion mark cannot be removed by a patch.
        if current["metadata"].get("deletionTimestamp"):
            meta["deletionTimestamp"] = current["metadata"]["deletionTimestamp"]
        if new.get("spec") != current.get("spec"):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        meta["resourceVersion"] = self._next_rv()
        await self._store(key, new, "MODIFIED")
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(key)

    @staticmethod
    def _scale(body: dict[str, Any]) -> dict[str, Any]:
        meta = body.get("metadata") or {}
        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "resourceVersion")},
            "spec": {"replicas": (body.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": (body.get("status") or {}).get("replicas", 0),
                       "selector": (body.get("status") or {}).get("selector", "")},
        }

    # -- diagnostics --

    def dump(self, plurals: tuple[str, ...] = ("inferenceservices", "pods", "events")) -> str:
        """The stored objects of those resources, one line each (what a failed test prints):
        resourceVersion, labels, finalizers, deletion mark, phase, conditions; the status of
        anything that is not a pod, the reason and message of events."""
        lines = [f"--- API emulator state (resourceVersion {self._rv})"]
        for (resource, namespace, name), obj in list(self._objects.items()):
            if resource.plural not in plurals or obj.deleted:
                continue
            raw = obj.raw
            meta = raw.get("metadata") or {}
            status = raw.get("status") or {}
            line = [f"{resource.plural}/{namespace}/{name} rv={meta.get('resourceVersion')}"]
            if resource.plural == "events":
                line.append(f"{raw.get('reason')}: {raw.get('message')}")
            else:
                line.append(f"labels={meta.get('labels') or {}}")
                for k in ("finalizers", "deletionTimestamp"):
                    if meta.get(k):
                        line.append(f"{k}={meta[k]}")
                if resource.plural == "pods":
                    conds = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
                    line.append(f"phase={status.get('phase')} conditions={conds}")
                else:
                    line.append(f"spec={raw.get('spec')} status={status}")
            lines.append(" ".join(line))
        return "\n".join(lines)

    # -- rendering overrides --

    async def _serve_create(self, request: rendering.Request) -> Any:
        # The stored object (with a generated name, uid, ...), not the one posted.
        return self._created.pop(id(request))

    async def _serve_fetch(self, request: rendering.Request) -> Any:
        body = await super()._serve_fetch(request)
        return self._scale(body) if request.subresource == "scale" else body

    async def _serve_update(self, request: rendering.Request) -> Any:
        body = await super()._serve_update(request)
        return self._scale(body) if request.subresource == "scale" else body

    def _matching(self, request: rendering.Request) -> list[dict[str, Any]]:
        selector = request.params.get("labelSelector")
        out = []
        for (resource, namespace, _), obj in self._objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if labels_match(obj.raw, selector):
                out.append(copy.deepcopy(obj.raw))
        return out

    async def _serve_list(self, request: rendering.Request) -> Any:
        if request.resource not in self._get_resources():
            raise k8s.KubernetesResourceNotFoundError()
        async with self._lock:
            items = self._matching(request)
        return {"apiVersion": request.resource.group and
                f"{request.resource.group}/{request.resource.version}" or request.resource.version,
                "kind": "List", "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now
        assert request.resource is not None
        # Subscribe before looking at the current state, so nothing falls in between.
        mark = await self._buses[request.resource].mark()
        since = request.params.get("resourceVersion")
        since_rv = int(since) if since and since.isdigit() else 0
        selector = request.params.get("labelSelector")
        if not since_rv:
            async with self._lock:
                items = self._matching(request)
            for item in items:
                yield {"type": "ADDED", "object": item}
        else:
            # Like the real server: everything since that version, even what changed between
            # the client's listing and this watch (kopf lists, then watches from the list's rv;
            # a peering keep-alive landing in between was lost before).
            async with self._lock:
                missed = [copy.deepcopy(e) for r, e in self._log if r == request.resource
                          and int(e["object"]["metadata"]["resourceVersion"]) > since_rv]
            for event in missed:
                meta = event["object"]["metadata"]
                if request.namespace is not None and meta.get("namespace") != request.namespace:
                    continue
                if request.name is not None and meta.get("name") != request.name:
                    continue
                if labels_match(event["object"], selector):
                    yield event
            if missed:
                since_rv = int(missed[-1]["object"]["metadata"]["resourceVersion"])
        async for event in mark:
            obj = event.get("object") or {}
            meta = obj.get("metadata") or {}
            if request.namespace is not None and meta.get("namespace") != request.namespace:
                continue
            if request.name is not None and meta.get("name") != request.name:
                continue
            if int(meta.get("resourceVersion") or 0) <= since_rv:
                continue  # the client has seen it already
            if not labels_match(obj, selector):
                continue
            yield event
