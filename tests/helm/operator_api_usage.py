"""Which (apiGroup, resource, verb) the operator uses, read from the operator's code.

- Our client: every `<kube>.<verb>(<RESOURCE CONSTANT>, ..., subresource=...)` call in
  operator/*.py (kube.py's verbs map 1:1 to RBAC verbs).
- kopf handlers: `@kopf.on.event(...)` watches (list, watch); `@kopf.daemon/timer/on.*`
  also patch the resource (kopf's finalizer and progress annotations).
- kopf itself, triggered by calls in our code: `kopf.event(...)` creates core Events;
  `kopf.run(namespaces=...)` lists/watches namespaces; a `peering_name` uses
  kopfpeerings (clusterkopfpeerings cluster-wide) with the verbs read from kopf's own
  peering code (kopf_peering_verbs), so a kopf upgrade that changes them fails the test.
"""

from __future__ import annotations

import ast
import pathlib

import kopf

from preheat.operator import resources

OPERATOR_DIR = pathlib.Path(__file__).resolve().parents[2] / "operator"
CLIENT_VERBS = {"get", "list", "create", "patch", "delete"}
Rule = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)


def _const(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and isinstance(getattr(resources, node.id, None), str):
        return getattr(resources, node.id)
    return None


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _kopf_resource(call: ast.Call) -> tuple[str, str]:
    args = [_const(a) for a in call.args]
    if len(args) == 3:  # group, version, plural
        return args[0] or "", args[2] or ""
    version, plural = args[0] or "", args[1] or ""  # "v1", "pods": the core group
    return ("" if "/" not in version else version.split("/")[0]), plural


KOPF_DIR = pathlib.Path(kopf.__file__).resolve().parent
# kopf's internal API calls (kopf/_cogs/clients/) and the RBAC verbs each one needs;
# a watcher lists first, then watches from the listing's resourceVersion.
KOPF_CLIENT_VERBS = {
    "api.get": {"get", "list"}, "api.post": {"create"}, "api.patch": {"patch"},
    "api.delete": {"delete"}, "api.stream": {"watch"}, "fetching.fetch_objs": {"list"},
    "creating.create_obj": {"create"}, "patching.patch_obj": {"patch"},
    "watching.infinite_watch": {"list", "watch"}, "watching.continuous_watch": {"list", "watch"},
    "queueing.watcher": {"list", "watch"},
}


def _kopf_calls(tree: ast.AST) -> set[str]:
    return {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)} | \
        {_dotted(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def kopf_peering_verbs() -> set[str]:
    """The verbs kopf's peering uses on the peering object: every kopf client call in its
    peering engine (keep-alives, cleanup of dead peers) plus the observer the orchestrator
    starts for it (passed as a function, hence attributes as well as calls)."""
    engine = ast.parse((KOPF_DIR / "_core" / "engines" / "peering.py").read_text())
    orchestration = ast.parse((KOPF_DIR / "_core" / "reactor" / "orchestration.py").read_text())
    [spawner] = [n for n in ast.walk(orchestration) if isinstance(n, ast.AsyncFunctionDef)
                 and n.name == "spawn_missing_peerings"]
    names = _kopf_calls(engine) | _kopf_calls(spawner)
    return set().union(*(verbs for call, verbs in KOPF_CLIENT_VERBS.items() if call in names))


def used_rules(peering: bool, namespaced: bool = True) -> set[Rule]:
    rules: set[Rule] = set()
    # An ownerReference with blockOwnerDeletion: true needs update on the owner's
    # finalizers (OwnerReferencesPermissionEnforcement), read off what render sets.
    from preheat.operator.render import owner_reference

    if owner_reference("x", "uid").get("blockOwnerDeletion"):
        rules.add((resources.GROUP, f"{resources.PLURAL}/finalizers", "update"))
    for path in sorted(OPERATOR_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in CLIENT_VERBS and node.args \
                    and isinstance(node.args[0], ast.Name):
                res = getattr(resources, node.args[0].id, None)
                if isinstance(res, resources.Resource):
                    sub = next((_const(k.value) for k in node.keywords
                                if k.arg == "subresource"), None)
                    name = f"{res.plural}/{sub}" if sub else res.plural
                    rules.add((res.group, name, node.func.attr))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for deco in node.decorator_list:
                    if not isinstance(deco, ast.Call):
                        continue
                    name = _dotted(deco.func)
                    if name in ("kopf.on.event", "kopf.daemon", "kopf.timer") or (
                            name.startswith("kopf.on.") and name not in (
                                "kopf.on.startup", "kopf.on.login", "kopf.on.cleanup",
                                "kopf.on.probe")):
                        group, plural = _kopf_resource(deco)
                        rules |= {(group, plural, "list"), (group, plural, "watch")}
                        if name != "kopf.on.event":
                            rules.add((group, plural, "patch"))
            if isinstance(node, ast.Call) and _dotted(node.func) == "kopf.event":
                rules.add(("", "events", "create"))
            if isinstance(node, ast.Call) and _dotted(node.func) == "kopf.run":
                kwargs = {k.arg for k in node.keywords}
                if "namespaces" in kwargs:
                    rules |= {("", "namespaces", "list"), ("", "namespaces", "watch")}
                if "peering_name" in kwargs and peering:
                    plural = "kopfpeerings" if namespaced else "clusterkopfpeerings"
                    rules |= {("kopf.dev", plural, v) for v in kopf_peering_verbs()}
    return rules


ROUTER_DIR = OPERATOR_DIR.parent / "router"


def _text(node: ast.AST) -> str:
    """A string literal, with an f-string's placeholders as {}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return ""


def router_rules() -> set[Rule]:
    """What `preheat router` does with the API, read from router/*.py: each collection path
    it requests (`/api/v1/namespaces/{}/<plural>` or `/apis/<group>/<v>/namespaces/{}/<plural>`)
    is listed; watched too where the same file sends a `watch` parameter."""
    import re

    path_re = re.compile(r"^/api/v1/namespaces/\{\}/([a-z]+)$|^/apis/([a-z0-9.]+)/[a-z0-9]+/namespaces/\{\}/([a-z]+)$")
    rules: set[Rule] = set()
    for path in sorted(ROUTER_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        watches = any(isinstance(n, ast.Dict) and any(_text(k) == "watch" for k in n.keys if k)
                      for n in ast.walk(tree))
        for node in ast.walk(tree):
            m = path_re.match(_text(node))
            if m:
                group, plural = ("", m.group(1)) if m.group(1) else (m.group(2), m.group(3))
                rules.add((group, plural, "list"))
                if watches:
                    rules.add((group, plural, "watch"))
    return rules
