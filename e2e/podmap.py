"""How the local kubelet turns a Pod into a local process: pure functions, no I/O.

A real kubelet runs the container image in its own filesystem and network namespace. The
local kubelet has neither, so it maps what the pod asks for onto this machine:

- the container's command: its first word is looked up in `commands` (e.g. "preheat" ->
  `<python> -m preheat`), the rest and the args are kept;
- volumes: each mounted volume becomes a local directory, and every env value or arg that
  names a path under a mountPath is rewritten to the local directory;
- the termination message file (terminationMessagePath, /dev/termination-log by default):
  a fresh local file per container start, named to the engine by
  PREHEAT_TERMINATION_MESSAGE_PATH;
- network: each pod gets its own loopback address (127.x.y.z) as its pod IP and listens on
  its container port there (the engine reads PREHEAT_HOST / PREHEAT_PORT), so podIP:8000
  reaches the pod as on a cluster network — which is how the operator scrapes /metrics.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Unsupported(ValueError):
    """The pod asks for something the local kubelet cannot map; the pod stays waiting."""


@dataclass(frozen=True)
class Volume:
    name: str
    kind: str  # "emptyDir" | "configMap" | "secret" | "persistentVolumeClaim" | "hostPath"
    source: str | None  # the ConfigMap, Secret or claim name, the host path


@dataclass(frozen=True)
class ProcessPlan:
    argv: tuple[str, ...]
    env: dict[str, str]
    mounts: dict[str, Path]  # mountPath -> local directory
    container_port: int
    host_port: int


@dataclass(frozen=True)
class Probe:
    path: str
    host_port: int
    period_s: float
    failure_threshold: int
    host: str = "127.0.0.1"  # the pod IP


def container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = (pod.get("spec") or {}).get("containers") or []
    if len(containers) != 1:
        raise Unsupported(f"the local kubelet runs pods of one container, got {len(containers)}")
    return containers[0]


def volumes(pod: Mapping[str, Any]) -> dict[str, Volume]:
    out: dict[str, Volume] = {}
    for v in (pod.get("spec") or {}).get("volumes") or []:
        if "emptyDir" in v:
            out[v["name"]] = Volume(v["name"], "emptyDir", None)
        elif "configMap" in v:
            out[v["name"]] = Volume(v["name"], "configMap", v["configMap"]["name"])
        elif "secret" in v:
            out[v["name"]] = Volume(v["name"], "secret", v["secret"]["secretName"])
        elif "persistentVolumeClaim" in v:
            out[v["name"]] = Volume(v["name"], "persistentVolumeClaim",
                                    v["persistentVolumeClaim"]["claimName"])
        elif "hostPath" in v:
            out[v["name"]] = Volume(v["name"], "hostPath", v["hostPath"]["path"])
        else:
            raise Unsupported(f"volume {v['name']!r}: only emptyDir, configMap, secret, hostPath and PVCs")
    return out


def volume_dir(pod: Mapping[str, Any], vol: Volume, root: Path,
               node_dirs: Mapping[str, Path]) -> Path:
    """Where a volume lives on this machine.

    emptyDir and configMap volumes belong to the pod; a claim is one directory per claim,
    shared by every pod that mounts it (what a ReadWriteMany volume is). node_dirs maps a
    volume name to a node-wide directory instead — used for the weight cache, see
    docs/e2e.md."""
    if vol.name in node_dirs:
        return node_dirs[vol.name]
    meta = pod["metadata"]
    if vol.kind == "persistentVolumeClaim":
        return claim_dir(root, meta["namespace"], vol.source or "")
    if vol.kind == "hostPath":  # the node's own directory: shared by that node's pods only
        node = (pod.get("spec") or {}).get("nodeName") or "node"
        return root / "nodes" / node / "hostpath" / (vol.source or "").strip("/")
    return root / "pods" / meta["uid"] / "volumes" / vol.name


def claim_dir(root: Path, namespace: str, claim: str) -> Path:
    return root / "claims" / namespace / claim


def rewrite_path(value: str, mounts: Mapping[str, Path]) -> str:
    """`/var/lib/preheat/snapshots/x` -> `<local dir>/x` for the longest matching mountPath."""
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return str(mounts[mount]) + value[len(mount.rstrip("/")):]
    return value


def secret_names(pod: Mapping[str, Any]) -> list[str]:
    """The Secrets the container's env reads keys of (secretKeyRef) or takes whole
    (envFrom secretRef), in order, once each."""
    names: list[str] = []
    refs = [(e.get("valueFrom") or {}).get("secretKeyRef") or {} for e in container(pod).get("env") or []]
    refs += [e.get("secretRef") or {} for e in container(pod).get("envFrom") or []]
    for ref in refs:
        if ref.get("name") and ref["name"] not in names:
            names.append(ref["name"])
    return names


def env_from(pod: Mapping[str, Any], secrets: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The container's envFrom secretRefs, each Secret's keys as variables (with the
    entry's prefix), as a kubelet sets them before `env`, which wins over them."""
    out: dict[str, str] = {}
    for entry in container(pod).get("envFrom") or []:
        ref = entry.get("secretRef")
        if ref is None:
            raise Unsupported("envFrom: only secretRef")
        data = secrets.get(ref.get("name"))
        if data is None:
            raise Unsupported(f"envFrom: Secret {ref.get('name')!r} was not fetched")
        out.update({entry.get("prefix", "") + k: v for k, v in data.items()})
    return out


def _env_value(entry: Mapping[str, Any], pod: Mapping[str, Any], pod_ip: str,
               secrets: Mapping[str, Mapping[str, str]]) -> str:
    if "value" in entry:
        return str(entry["value"])
    secret_ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
    if secret_ref is not None:
        # The kubelet reads the Secret before it starts the container (and waits in
        # CreateContainerConfigError while it or the key is missing): here it is at hand.
        value = (secrets.get(secret_ref.get("name")) or {}).get(secret_ref.get("key"))
        if value is None:
            raise Unsupported(f"env {entry['name']!r}: Secret {secret_ref.get('name')!r} key "
                              f"{secret_ref.get('key')!r} was not fetched")
        return value
    ref = ((entry.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
    fields = {"metadata.name": pod["metadata"]["name"],
              "metadata.namespace": pod["metadata"]["namespace"],
              "status.podIP": pod_ip}
    if ref in fields:
        return fields[ref]
    if not entry.get("valueFrom"):
        return ""
    raise Unsupported(f"env {entry['name']!r}: only values, secretKeyRefs and fieldRefs to "
                      "name/namespace/podIP")


_SERVICE_URL = re.compile(r"^(https?://)([a-z0-9]([-a-z0-9]*[a-z0-9])?)"
                          r"((\.[a-z0-9-]+)?\.svc(\.cluster\.local)?)?:([0-9]+)(/.*)?$")


def service_hosts(pod: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(service, port) of every env value that is a URL of an in-cluster Service by DNS
    name: `http://name:port`, `http://name.ns.svc:port`, `...svc.cluster.local:port`."""
    out = []
    for entry in container(pod).get("env") or []:
        m = _SERVICE_URL.match(str(entry.get("value") or ""))
        if m:
            out.append((m.group(2), int(m.group(7))))
    return out


def rewrite_hosts(value: str, hosts: Mapping[str, str]) -> str:
    """What cluster DNS + the Service do for a URL, mapped onto this machine: the host and
    port of a known Service become the address of its local stand-in."""
    m = _SERVICE_URL.match(value)
    if not m or f"{m.group(2)}:{m.group(7)}" not in hosts:
        return value
    return f"{m.group(1)}{hosts[m.group(2) + ':' + m.group(7)]}{m.group(8) or ''}"


def plan(pod: Mapping[str, Any], *, commands: Mapping[str, Sequence[str]], host_port: int,
         root: Path, node_dirs: Mapping[str, Path] = {},
         base_env: Mapping[str, str] = {}, pod_ip: str = "127.0.0.1",
         hosts: Mapping[str, str] = {},
         secrets: Mapping[str, Mapping[str, str]] = {},
         termination_log: Path | None = None) -> ProcessPlan:
    c = container(pod)
    command = list(c.get("command") or [])
    if not command or command[0] not in commands:
        raise Unsupported(f"command {command!r}: the local kubelet only knows {sorted(commands)}")
    ports = c.get("ports") or []
    if len(ports) != 1:
        raise Unsupported("the local kubelet maps exactly one container port")
    container_port = int(ports[0]["containerPort"])
    vols = volumes(pod)
    mounts = {m["mountPath"]: volume_dir(pod, vols[m["name"]], root, node_dirs)
              for m in c.get("volumeMounts") or []}
    args = [rewrite_path(a, mounts) for a in [*command[1:], *(c.get("args") or [])]]
    if any(a == "--port" or a.startswith("--port=") or a == "--host" for a in args):
        raise Unsupported("--port/--host in args: the local kubelet owns the address")
    env = {**base_env, **env_from(pod, secrets)}
    for entry in c.get("env") or []:
        env[entry["name"]] = rewrite_hosts(rewrite_path(_env_value(entry, pod, pod_ip, secrets), mounts),
                                           hosts)
    if termination_log is not None:
        # The file the kubelet mounts at the container's terminationMessagePath, mapped.
        env["PREHEAT_TERMINATION_MESSAGE_PATH"] = str(termination_log)
    # The pod's network namespace, mapped: its own loopback address.
    env["PREHEAT_HOST"] = pod_ip
    env["PREHEAT_PORT"] = str(host_port)
    return ProcessPlan(argv=(*commands[command[0]], *args), env=env, mounts=mounts,
                       container_port=container_port, host_port=host_port)


SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def mounts_service_account(pod: Mapping[str, Any]) -> bool:
    """Whether a cluster would mount the pod's service account token (the ServiceAccount
    admission plugin adds the projected volume unless automountServiceAccountToken is false)."""
    return (pod.get("spec") or {}).get("automountServiceAccountToken") is not False


def service_account_env(api_url: str, local_dir: Path) -> dict[str, str]:
    """What a container of such a pod finds: the API's address in KUBERNETES_SERVICE_HOST /
    PORT (set by every kubelet) and, mapped like the pod's network, where the token volume
    is here: the router's --service-account-dir (PREHEAT_ROUTER_SERVICE_ACCOUNT_DIR) instead
    of SERVICE_ACCOUNT_MOUNT, which the local kubelet cannot mount."""
    from urllib.parse import urlsplit

    url = urlsplit(api_url)
    return {"KUBERNETES_SERVICE_HOST": url.hostname or "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(url.port or (443 if url.scheme == "https" else 80)),
            "PREHEAT_ROUTER_SERVICE_ACCOUNT_DIR": str(local_dir)}


def probe(pod: Mapping[str, Any], kind: str, host_port: int,
          host: str = "127.0.0.1") -> Probe | None:
    """The container's `kind` probe ("startupProbe", "readinessProbe"), aimed at host:host_port."""
    c = container(pod)
    spec = c.get(kind)
    if not spec:
        return None
    get = spec.get("httpGet")
    if not get:
        raise Unsupported(f"{kind}: only httpGet")
    port = get.get("port")
    names = {p.get("name") for p in c.get("ports") or []}
    if isinstance(port, str) and port not in names:
        raise Unsupported(f"{kind}: unknown port name {port!r}")
    return Probe(path=get.get("path") or "/", host_port=host_port,
                 period_s=float(spec.get("periodSeconds", 10)),
                 failure_threshold=int(spec.get("failureThreshold", 3)), host=host)


def pre_stop_sleep_s(pod: Mapping[str, Any]) -> float:
    """The container's `lifecycle.preStop.sleep.seconds` (0 when none). Other preStop
    handlers (exec, httpGet) are not run by the local kubelet."""
    sleep = ((container(pod).get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
    return float(sleep.get("seconds") or 0)


def grace_period_s(pod: Mapping[str, Any]) -> float:
    return float((pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
