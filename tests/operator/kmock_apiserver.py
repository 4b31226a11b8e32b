"""kmock's KubernetesEmulator, grown into enough of an API server to run kopf operators on.

kmock 0.8's emulator stores objects and streams changes, but it is not an API server:
no uid/resourceVersion/generation, JSON-patch applied as a merge, watches that miss
events between listing and subscribing, no label selectors, no status/scale subresources,
no garbage collector. This subclass adds exactly those, so the real kopf operator (and
issue 7's end-to-end harness) can run against it:

    async with KubeAPIServer() as api, kmock.Server(api) as server:
        kubeconfig = write_kubeconfig(tmp_path, server.url)

It also speaks enough of the API server's surface for the real kubectl and helm:
`/openapi/v2` and `/openapi/v3` (kmock_openapi.py), Tables for `kubectl get`
(kmock_printing.py, a CRD's printer columns), admission of custom resources like the
apiextensions-apiserver (kmock_admission.py: pruning or `fieldValidation=Strict` refusal,
defaults, schema and CEL validation, the API server's Status messages), the `scale`
subresource at the CRD's `subresources.scale` paths, CRDs created through the API
(`kubectl apply -f crds/`, helm's crds/) served at once, server-side apply (helm 4's default:
create-or-merge, without field ownership), PUT, field selectors (`kubectl wait`), aggregated
discovery (kmock_discovery.py), watch-lists with their initial-events bookmark, protobuf
bodies of Secrets and ConfigMaps (kmock_protobuf.py: helm's release storage).

Not modelled: admission of built-in kinds (no validation or defaulting of pods,
deployments, ...), resource quotas, RBAC, SSA field ownership (managedFields, conflicts),
the scheduler and the kubelet (tests play the kubelet by patching pod status).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import pathlib
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import kmock
import kmock_openapi as openapi
import yaml
from kmock._internal import apps, enums, k8s, parsing, references, rendering
from kmock_admission import CustomResourceType, Refusal, resource_types
from kmock_discovery import MEDIA_TYPE as AGGREGATED
from kmock_discovery import group_list, wants_aggregated
from kmock_printing import table, wants_table
from kmock_protobuf import MEDIA_TYPE as PROTOBUF
from kmock_protobuf import UnsupportedProtobuf, decode

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


def fields_match(obj: dict[str, Any], selector: str | None, custom: bool = False) -> bool:
    """Field selectors (=, ==, !=). A custom resource supports metadata.name and
    metadata.namespace only (kubectl wait and kubectl get NAME -w use metadata.name), as on
    the API server; a built-in kind any path of its object (the real server allows a few per
    kind: spec.nodeName and status.phase of pods, involvedObject.* of events, ...). A missing
    field compares as ""."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        negate = "!=" in term
        key, value = term.split("!=" if negate else "=", 1)
        key, value = key.strip(), value.lstrip("=").strip()
        if custom and key not in ("metadata.name", "metadata.namespace"):
            raise k8s.KubernetesError(status=400, reason="BadRequest", message=f"field label not supported: {key}")
        found = _get_path(obj, key)
        if (str(found if found is not None else "") == value) == negate:
            return False
    return True


def _get_path(obj: dict[str, Any], path: str) -> Any:
    for part in path.strip(".").split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.strip(".").split(".")
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    obj[parts[-1]] = value


@attrs.frozen
class ServedCustomResource:
    """One served version of a CRD: its admission, printer columns and scale paths."""

    crd: dict[str, Any]
    admission: CustomResourceType | None
    printer_columns: list[dict[str, Any]]
    scale: dict[str, str] | None  # subresources.scale: specReplicasPath, statusReplicasPath, ...


SERVER_VERSION = {"major": "1", "minor": openapi.SCHEMA_VERSION.split(".")[1],
                  "gitVersion": f"v{openapi.SCHEMA_VERSION}", "gitCommit": "kmock-emulator",
                  "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24",
                  "compiler": "gc", "platform": "linux/amd64"}
APPLY = "application/apply-patch+yaml"
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")


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
    _custom: dict[Any, ServedCustomResource] = attrs.field(factory=dict, init=False)
    _warnings: dict[int, list[str]] = attrs.field(factory=dict, init=False)
    _openapi: dict[str, Any] = attrs.field(factory=dict, init=False)  # cache, cleared by declare_crd

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
            types = resource_types(crd)
            self._custom[kmock.resource(spec["group"], version["name"], spec["names"]["plural"])] = \
                ServedCustomResource(crd=crd, admission=types.get(version["name"]),
                                     printer_columns=list(version.get("additionalPrinterColumns") or []),
                                     scale=(version.get("subresources") or {}).get("scale"))
        self._openapi.clear()

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

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """A protobuf body (client-go's typed clients: helm's release Secret) is decoded into
        the JSON kmock parses; a kind it cannot decode is a 415, as from a server without it."""
        body = await raw_request.read()
        if raw_request.content_type == PROTOBUF and body:
            try:
                raw_request._read_bytes = json.dumps(decode(body)).encode()  # what .json() reads
            except UnsupportedProtobuf as e:
                return aiohttp.web.json_response(
                    Refusal(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: "
                            f"{e}").status(), status=415)
        return await super().__call__(raw_request)

    async def _handle(self, request: rendering.Request) -> Any:
        if request.url.path.startswith("/openapi/"):
            return self._serve_openapi(request)
        if request.url.path in ("/api", "/apis") and wants_aggregated(request.headers.get("Accept")):
            listing = group_list([(r, self.resources[r]) for r in list(self.resources)],
                                 core=request.url.path == "/api")
            return aiohttp.web.json_response(listing, content_type=None, headers={"Content-Type": AGGREGATED})
        if request.action == enums.action.WATCH and request.resource is not None:
            return await self._stream_watch(request)
        try:
            if request.resource is not None:
                async with self._lock:
                    if request.action == enums.action.CREATE:
                        self._created[id(request)] = await self._create(request)
                    elif request.action == enums.action.UPDATE and request.name is not None:
                        await self._patch(request)
                    elif request.method == enums.method.PUT and request.name is not None:
                        return aiohttp.web.json_response(await self._replace(request))
                    elif request.action == enums.action.DELETE and request.name is not None:
                        key = (request.resource, request.namespace, request.name)
                        if self._live(key) is None:
                            raise k8s.KubernetesObjectNotFoundError()
                        await self._delete(key)
        except Refusal as refusal:
            return aiohttp.web.json_response(refusal.status(), status=refusal.code)
        # Skip KubernetesEmulator._handle (its own, simpler state changes): render only.
        response = await apps.RawHandler._handle(self, request)
        for warning in self._warnings.pop(id(request), []):
            response.headers.add("Warning", f"299 - {json.dumps(warning)}")
        return response

    def _admit(self, request: rendering.Request, body: dict[str, Any], patch: Any = None) -> dict[str, Any]:
        """A custom resource's body as the API server would store it (or a Refusal)."""
        served = self._custom.get(request.resource)
        if served is None or served.admission is None:
            return body
        admitted = served.admission.admit(body, request.params.get("fieldValidation"), patch=patch)
        self._warnings.setdefault(id(request), []).extend(admitted.warnings)
        return admitted.body

    async def _create(self, request: rendering.Request, data: Any = None) -> dict[str, Any]:
        if request.resource not in self.resources:
            raise k8s.KubernetesResourceNotFoundError()
        body = copy.deepcopy(request.data if data is None else data) or {}
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
            status = body.get("status") or {}
            status.setdefault("phase", "Pending")  # kubectl run sends "status": {}
            body["status"] = status
        if request.resource in self._custom and self._has_status(request.resource):
            body.pop("status", None)  # like the API server: a CR's status is written through /status only
        body = self._admit(request, body)
        if request.resource == CRDS:
            body["status"] = self._establish(body)
        if key not in self._objects:
            self._objects[key] = {}
            self._objects[key].history.clear()
        await self._store(key, body, "ADDED")
        return copy.deepcopy(body)

    async def _replace(self, request: rendering.Request) -> dict[str, Any]:
        """PUT: the whole object, if its resourceVersion (when given) is the stored one."""
        key = (request.resource, request.namespace, request.name)
        obj = self._live(key)
        if obj is None:
            raise k8s.KubernetesObjectNotFoundError()
        current = obj.raw
        new = copy.deepcopy(request.data or {})
        meta = new.setdefault("metadata", {})
        given = meta.get("resourceVersion")
        if given and given != current["metadata"].get("resourceVersion"):
            raise Refusal(409, "Conflict", f'Operation cannot be fulfilled on {request.resource.plural} '
                          f'"{request.name}": the object has been modified; please apply your changes to the '
                          f'latest version and try again', {"name": request.name, "kind": request.resource.plural})
        for fixed in ("uid", "name", "namespace", "creationTimestamp", "generation", "deletionTimestamp"):
            if fixed in current.get("metadata", {}):
                meta[fixed] = current["metadata"][fixed]
        if self._has_status(request.resource) and request.subresource is None:
            new["status"] = current.get("status")
            if new["status"] is None:
                new.pop("status")
        if new.get("spec") != current.get("spec"):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        new = self._admit(request, new, patch=None)
        new["metadata"]["resourceVersion"] = self._next_rv()
        await self._store(key, new, "MODIFIED")
        return copy.deepcopy(new)

    def _establish(self, crd: dict[str, Any]) -> dict[str, Any]:
        """A CRD created through the API is served at once (the real server takes a moment),
        with the status conditions clients wait for."""
        self.declare_crd(crd)
        now = _now()
        return {"acceptedNames": crd["spec"]["names"], "storedVersions": [
            v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
            "conditions": [{"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": now}
                           for t, r, m in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                                           ("Established", "InitialNamesAccepted",
                                            "the initial names have been accepted"))]}

    async def _patch(self, request: rendering.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        obj = self._live(key)
        ctype = (request.headers.get("Content-Type") or "").split(";")[0]
        if ctype == APPLY:
            data = yaml.safe_load(request.text or "null")
        else:
            data = request.data if request.data is not None else json.loads(request.text or "null")
        if obj is None:
            if ctype == APPLY and request.subresource is None:  # server-side apply creates
                await self._create(request, data)
                return
            raise k8s.KubernetesObjectNotFoundError()
        current = copy.deepcopy(obj.raw)
        sub = request.subresource
        if sub == "scale":
            # The patch is against a Scale object; only spec.replicas maps back.
            scale = merge_patch(self._scale(current, self._scale_paths(request.resource)), data)
            new = copy.deepcopy(current)
            _set_path(new, self._scale_paths(request.resource)["specReplicasPath"], scale["spec"]["replicas"])
        else:
            if ctype == "application/json-patch+json":
                new = json_patch(current, data)
            elif ctype in ("application/strategic-merge-patch+json", APPLY):
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
        new = self._admit(request, new, patch=data)
        if request.resource == CRDS:
            new["status"] = self._establish(new)
        meta = new["metadata"]
        meta["resourceVersion"] = self._next_rv()
        await self._store(key, new, "MODIFIED")
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(key)

    def _scale_paths(self, resource: Any) -> dict[str, str]:
        served = self._custom.get(resource)
        return (served.scale if served is not None and served.scale else
                {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                 "labelSelectorPath": ".status.selector"})

    @staticmethod
    def _scale(body: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
        """The autoscaling/v1 Scale the API server serves for a CR at its CRD's scale paths."""
        meta = body.get("metadata") or {}
        status = {"replicas": _get_path(body, paths["statusReplicasPath"]) or 0}
        if paths.get("labelSelectorPath"):
            status["selector"] = _get_path(body, paths["labelSelectorPath"]) or ""
        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "resourceVersion",
                                                  "creationTimestamp")},
            "spec": {"replicas": _get_path(body, paths["specReplicasPath"]) or 0},
            "status": status,
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
        if request.subresource == "scale":
            return self._scale(body, self._scale_paths(request.resource))
        if wants_table(request.headers.get("Accept")) and request.subresource is None:
            return self._table(request, [body])
        return body

    async def _serve_update(self, request: rendering.Request) -> Any:
        body = await super()._serve_update(request)
        return self._scale(body, self._scale_paths(request.resource)) if request.subresource == "scale" else body

    async def _serve_server_version(self, request: rendering.Request) -> Any:
        return SERVER_VERSION

    async def _stream_watch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """_serve_watch's events as the API server streams them: one JSON object a line, as
        `Content-Type: application/json` (kmock's own streams are application/octet-stream,
        which client-go refuses: "no stream serializers registered for application/octet-stream")."""
        if request.resource not in self._get_resources():
            raise k8s.KubernetesResourceNotFoundError()
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        assert request._raw_request is not None
        await response.prepare(request._raw_request)
        with contextlib.suppress(ConnectionError):
            async for event in self._serve_watch(request):
                if event != b"":
                    await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
        return response

    async def _serve_version(self, request: rendering.Request) -> Any:
        """kmock's APIResourceList, with subresources as the API server lists them: no short
        names or categories (kubectl would warn that `pis` could also mean pis/status), the
        Scale kind of autoscaling/v1 for /scale, and only the verbs they serve."""
        listing = await super()._serve_version(request)
        if request.resource is not None and not request.resource.group:
            listing["groupVersion"] = request.resource.version  # "v1", not "/v1"
        for entry in listing.get("resources", []):
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[], singularName="", verbs=["get", "patch", "update"])
                if entry["name"].endswith("/scale"):
                    entry.update(kind="Scale", group="autoscaling", version="v1")
        return listing

    def _table(self, request: rendering.Request, objects: list[dict[str, Any]]) -> dict[str, Any]:
        served = self._custom.get(request.resource)
        return table(objects, served.printer_columns if served is not None else None, str(self._rv))

    def _matching(self, request: rendering.Request) -> list[dict[str, Any]]:
        selector = request.params.get("labelSelector")
        field_selector = request.params.get("fieldSelector")
        out = []
        for (resource, namespace, _), obj in self._objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if labels_match(obj.raw, selector) and \
                    fields_match(obj.raw, field_selector, request.resource in self._custom):
                out.append(copy.deepcopy(obj.raw))
        return out

    async def _serve_list(self, request: rendering.Request) -> Any:
        if request.resource not in self._get_resources():
            raise k8s.KubernetesResourceNotFoundError()
        async with self._lock:
            items = self._matching(request)
        if wants_table(request.headers.get("Accept")):
            return self._table(request, items)
        kind = self.resources[request.resource].kind if request.resource in self.resources else None
        return {"apiVersion": request.resource.group and
                f"{request.resource.group}/{request.resource.version}" or request.resource.version,
                "kind": f"{kind}List" if kind else "List", "metadata": {"resourceVersion": str(self._rv)},
                "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now
        assert request.resource is not None
        # Subscribe before looking at the current state, so nothing falls in between.
        mark = await self._buses[request.resource].mark()
        since = request.params.get("resourceVersion")
        since_rv = int(since) if since and since.isdigit() else 0
        selector = request.params.get("labelSelector")
        field_selector = request.params.get("fieldSelector")
        # A watch-list (kubectl 1.35's informers: sendInitialEvents=true) gets the current
        # objects as ADDED, then a BOOKMARK marking the end of them (KEP-3157), whatever its
        # resourceVersion (resourceVersionMatch=NotOlderThan).
        initial = request.params.get("sendInitialEvents") == "true"
        if not since_rv or initial:
            async with self._lock:
                items = self._matching(request)
                listed_rv = self._rv
            for item in items:
                yield {"type": "ADDED", "object": item}
            if initial:
                since_rv = listed_rv
                info = self.resources[request.resource] if request.resource in self.resources else None
                group_version = "/".join(filter(None, (request.resource.group, request.resource.version)))
                yield {"type": "BOOKMARK", "object": {
                    "kind": info.kind if info is not None else None, "apiVersion": group_version,
                    "metadata": {"resourceVersion": str(listed_rv),
                                 "annotations": {"k8s.io/initial-events-end": "true"}}}}
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
                if labels_match(event["object"], selector) and \
                        fields_match(event["object"], field_selector, request.resource in self._custom):
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
            if not labels_match(obj, selector) or \
                    not fields_match(obj, field_selector, request.resource in self._custom):
                continue
            yield event

    # -- OpenAPI --

    def _group_versions(self) -> dict[str, list[Any]]:
        """"apis/apps/v1" / "api/v1" -> the resources served there."""
        out: dict[str, list[Any]] = {}
        for resource in self.resources:
            if resource.version is None or resource.plural is None or "/" in resource.plural:
                continue
            gv = f"apis/{resource.group}/{resource.version}" if resource.group else f"api/{resource.version}"
            out.setdefault(gv, []).append(resource)
        return out

    def _definitions(self) -> dict[str, Any]:
        defs = dict(openapi.builtin_definitions())
        for served in self._custom.values():
            defs.update(openapi.crd_definitions(served.crd))
        return defs

    def _gv_paths(self, resources: list[Any]) -> tuple[dict[str, Any], set[str]]:
        defs = self._definitions()
        paths: dict[str, Any] = {}
        kinds: set[str] = set()
        for resource in resources:
            info = self.resources[resource]
            if not info.kind:
                continue
            paths.update(openapi.paths(resource.group or "", resource.version, resource.plural, info.kind,
                                       bool(info.namespaced), set(info.subresources or ())))
            names = openapi.kind_definitions(defs, resource.group or "", resource.version)
            if info.kind in names:
                kinds.add(names[info.kind])
        return paths, kinds

    def _openapi_docs(self) -> dict[str, Any]:
        """Built once per set of CRDs: v2, the v3 index and each group-version's v3 document."""
        if not self._openapi:
            defs = self._definitions()
            all_paths: dict[str, Any] = {}
            v3: dict[str, Any] = {}
            for gv, resources in sorted(self._group_versions().items()):
                paths, kinds = self._gv_paths(resources)
                all_paths.update(paths)
                v3[gv] = openapi.to_v3(paths, openapi.closure(kinds | {f"{openapi.META}Status"}, defs))
            self._openapi.update(v2=openapi.swagger(all_paths, defs), v3=v3, index={"paths": {
                gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash={openapi.digest(doc)}"}
                for gv, doc in v3.items()}})
        return self._openapi

    def _serve_openapi(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        docs = self._openapi_docs()
        path = request.url.path.rstrip("/")
        if path == "/openapi/v2":
            return aiohttp.web.json_response(docs["v2"])
        if path == "/openapi/v3":
            return aiohttp.web.json_response(docs["index"])
        doc = docs["v3"].get(path.removeprefix("/openapi/v3/"))
        if doc is None:
            status = k8s.KubernetesEndpointNotFoundError()
            return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                              "status": "Failure", "message": status.message,
                                              "reason": "NotFound", "code": 404}, status=404)
        return aiohttp.web.json_response(doc)
