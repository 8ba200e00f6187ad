"""LoRA adapters for the demo models, made offline and the same bytes on every machine.

No hub is reachable, and PEFT is not needed to write an adapter vLLM loads: an
``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's tensor names. Weights come
from a PCG64 integer stream turned into float32 exactly, as the demo model's do
(``ucm.deploy.demo_model``), so nothing depends on the CPU. The adapter targets every attention
projection, K and V included: its requests' KV differs from the base model's at every layer.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from ucm.deploy.demo_model import ModelSpec

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def ensure_adapter(model: ModelSpec, seed: int, root: Path, scale: float = 0.25) -> Path:
    """The adapter of ``seed`` for ``model`` under ``root`` (built once; concurrent callers safe)."""
    target = root / f"{model.name}-lora-{seed}-{scale}"
    if (target / "adapter_config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".adapter-", dir=root))
    try:
        build_adapter(model, seed, tmp, scale)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "adapter_config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_adapter(model: ModelSpec, seed: int, out: Path, scale: float) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    h, d = model.hidden_size, model.head_dim
    dims = {  # (in, out) of each target projection
        "q_proj": (h, model.num_heads * d),
        "k_proj": (h, model.num_kv_heads * d),
        "v_proj": (h, model.num_kv_heads * d),
        "o_proj": (model.num_heads * d, h),
    }
    shapes: dict[str, tuple[int, int]] = {}
    for i in range(model.num_layers):
        for proj in TARGETS:
            fan_in, fan_out = dims[proj]
            name = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            shapes[f"{name}.lora_A.weight"] = (RANK, fan_in)
            shapes[f"{name}.lora_B.weight"] = (fan_out, RANK)
    bits = np.random.PCG64(seed)
    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name]
        ints = (bits.random_raw(int(np.prod(shape))) >> np.uint64(40)).astype(np.int64) - (1 << 23)
        tensors[name] = (ints.astype(np.float32) * np.float32(scale / (1 << 23))).reshape(shape)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model.name,
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
