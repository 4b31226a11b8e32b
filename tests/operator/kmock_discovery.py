"""Aggregated discovery for the API emulator (a test part), as kube-apiserver serves it.

Since Kubernetes 1.30, `/api` and `/apis` answer a client that asks for
`application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList` (kubectl and helm
do) with every group, version and resource in one document, instead of one request per
group-version (https://kubernetes.io/docs/concepts/overview/kubernetes-api/#aggregated-discovery).
A client that gets the legacy answer falls back to it, so this is about serving what a
real server serves, and doing it in 2 requests rather than ~30.
"""

from __future__ import annotations

import re
from typing import Any

MEDIA_TYPE = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"


def wants_aggregated(accept: str | None) -> bool:
    """The client lists the v2 aggregated type (client-go names it first when it does)."""
    return bool(accept) and any(
        "as=APIGroupDiscoveryList" in part and "v=v2" in part.replace("v=v2beta1", "")
        for part in accept.split(","))


def version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' version order: GA before beta before alpha, higher numbers first."""
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not match:
        return (-1, 0, 0)
    major, stage, minor = match.groups()
    return (int(major), {"alpha": 0, "beta": 1, None: 2}[stage], int(minor or 0))


def _entry(group: str, version: str, plural: str, info: Any) -> dict[str, Any]:
    kind = info.kind or plural.capitalize()
    subresources = []
    for sub in sorted(info.subresources or ()):
        response = ({"group": "autoscaling", "version": "v1", "kind": "Scale"} if sub == "scale"
                    else {"group": group, "version": version, "kind": kind})
        subresources.append({"subresource": sub, "responseKind": response, "verbs": ["get", "patch", "update"]})
    entry: dict[str, Any] = {
        "resource": plural, "responseKind": {"group": group, "version": version, "kind": kind},
        "scope": "Namespaced" if info.namespaced else "Cluster",
        "singularResource": info.singular or kind.lower(), "verbs": sorted(info.verbs or ()),
    }
    if info.shortnames:
        entry["shortNames"] = sorted(info.shortnames)
    if info.categories:
        entry["categories"] = sorted(info.categories)
    if subresources:
        entry["subresources"] = subresources
    return entry


def group_list(resources: list[tuple[Any, Any]], core: bool) -> dict[str, Any]:
    """The APIGroupDiscoveryList of `/api` (core: the "" group) or `/apis` (every other)."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for resource, info in resources:
        group = resource.group or ""
        if (group == "") != core or not resource.version or not resource.plural or "/" in resource.plural:
            continue
        groups.setdefault(group, {}).setdefault(resource.version, []).append(
            _entry(group, resource.version, resource.plural, info))
    items = []
    for group in sorted(groups):
        versions = sorted(groups[group], key=version_priority, reverse=True)
        items.append({"metadata": {"name": group, "creationTimestamp": None}, "versions": [
            {"version": v, "resources": sorted(groups[group][v], key=lambda e: e["resource"]), "freshness": "Current"}
            for v in versions]})
    return {"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {}, "items": items}
