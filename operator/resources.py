"""Every Kubernetes resource the operator touches, named once.

The operator's API calls take one of these constants as their first argument, so the
set of (resource, verb) pairs the operator uses can be read off the code — the Helm
chart's RBAC test derives the ClusterRole from exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "serving.preheat.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
API_VERSION = f"{GROUP}/{VERSION}"

# Labels and the readiness-gate condition are a contract with the engine side and
# the e2e harness (see DESIGN.md: pod labels, serving).
LABEL_SERVICE = "preheat.dev/service"
LABEL_ROLE = "preheat.dev/role"
LABEL_TEMPLATE_HASH = "preheat.dev/template-hash"
ROLE_SERVING = "serving"
ROLE_WARM = "warm"
# A serving pod on its way out: already out of the Service's endpoints (it no longer
# matches role=serving), deleted once they have had time to notice (DRAINING_SINCE).
ROLE_DRAINING = "draining"
# The router pods (`preheat router`): outside the engine pod set, never promoted or demoted.
ROLE_ROUTER = "router"
WARM_CONDITION = "preheat.dev/warm"
DRAINING_SINCE = "preheat.dev/draining-since"  # pod annotation, RFC 3339


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core API
    version: str
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        url = f"{base}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            url += f"/{name}"
            if subresource is not None:
                url += f"/{subresource}"
        return url


INFERENCE_SERVICES = Resource(GROUP, VERSION, PLURAL)
PODS = Resource("", "v1", "pods")
SERVICES = Resource("", "v1", "services")
PVCS = Resource("", "v1", "persistentvolumeclaims")
CONFIGMAPS = Resource("", "v1", "configmaps")
# Created only (the per-service peer secret, reconcile._ensure_peer_secret): the operator
# never reads a Secret; a missing one shows in the pods' status (operator/pod_config.py).
SECRETS = Resource("", "v1", "secrets")
HPAS = Resource("autoscaling", "v2", "horizontalpodautoscalers")
PDBS = Resource("policy", "v1", "poddisruptionbudgets")
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies")
