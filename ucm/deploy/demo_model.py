"""Small Llama models made offline, the same bytes on every machine: ``ucm up``'s default model,
and the model tests and benchmarks run vLLM with.

No model hub is reachable from CI, so models are made here: a byte-level BPE tokenizer trained on a
fixed text (integer counting: deterministic), and weights drawn from a PCG64 integer stream turned
into float32 exactly (24-bit integers times a power of two). Nothing is trained and no float
reduction is involved, so the weights do not depend on the CPU, its vector width or its thread
count (training did: another CPU built another model, with near-ties). ``digest`` names the bytes;
tests pin it.

Random weights at the usual init scale repeat one token; these use larger scales (attention queries
and keys, and the output head) so that greedy continuations are varied, depend on the whole prompt,
and have clear top-2 margins. The result is cached under ``~/.cache/ucm/models/<name>-<fingerprint>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The tokenizer's training text, and the source of the test prompts.
CORPUS = """
The cache keeps every block of the prompt outside the accelerator, so a second instance can load it.
A river runs through the old town, past the bakery, the library and the quiet station.
Seven ships left the harbor at dawn; three returned before the storm reached the coast.
Engineers measure before they optimize, and they write down what they measured.
The scheduler asks the store how many blocks exist, then loads them before the first layer runs.
In the spring the orchard turns white, and bees move from tree to tree until the evening.
Prefill computes the prompt once; decode reads the same blocks and writes one token at a time.
Mathematics is the art of giving the same name to different things, said a famous mathematician.
The proxy sends the request to a prefill server first and then streams the answer from decode.
Copper conducts heat well, glass does not, and wood burns when the fire is hot enough.
A tenant salt keeps the blocks of one customer apart from those of every other customer.
She opened the window, counted the stars, and wrote the numbers in a small green notebook.
Kubernetes restarts a pod that fails its probe, and the operator records why in the status.
The violin, the cello and the piano played a slow piece that nobody in the hall had heard.
Hash the tokens of each full block together with the id of the block before it.
Winter roads are icy at night; drivers slow down near bridges and on the northern hills.
A corrupt file on disk must become a miss, never a wrong answer served to a user.
The museum opens at nine, closes at five, and is free on the first Sunday of every month.
""".strip()

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
WEIGHTS_FILE = "model.safetensors"

# Half-width of the uniform distribution each weight is drawn from, by the first name part that
# matches (norm weights are 1). Chosen by measurement: continuations vary and follow the context.
DEFAULT_SCALES = (
    ("embed_tokens", 1.0),
    ("lm_head", 4.0),
    ("q_proj", 0.25),
    ("k_proj", 0.25),
    ("v_proj", 0.125),
    ("o_proj", 0.125),
    ("mlp", 0.125),
)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 4096
    seed: int = 2
    scales: tuple[tuple[str, float], ...] = field(default=DEFAULT_SCALES)
    version: int = 2  # bump when the recipe changes: the cache key changes with it

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


# head_dim 64: vLLM's CPU attention needs >= 64. 2 KV heads x 64 x 2 layers: 2 KiB of KV per token.
TINY = ModelSpec(
    "tiny-llama",
    vocab_size=512,
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
)
# For benchmarks: 8 layers x 8 KV heads x 64: 32 KiB of KV per token in float32; a 2,000-token prefill
# takes ~4.5 s on 2 cores (measured by benchmarks/connector_ttft.py).
BENCH = ModelSpec(
    "bench-llama",
    vocab_size=512,
    hidden_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=2816,
)
MODELS = {m.name: m for m in (TINY, BENCH)}


def cache_dir() -> Path:
    return Path(os.environ.get("UCM_MODEL_CACHE", Path.home() / ".cache" / "ucm" / "models"))


def ensure_model(spec: ModelSpec = TINY, root: Path | None = None) -> Path:
    """Path to the generated model, building it once (atomically: concurrent callers are safe)."""
    root = root or cache_dir()
    target = root / f"{spec.name}-{spec.fingerprint()}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=root))
    try:
        build(spec, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise  # someone else won the race only if the target is complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def digest(model_dir: Path) -> str:
    """sha256 over the weights file and the tokenizer's vocabulary and merges (not over files whose
    text carries library versions, such as config.json)."""
    h = hashlib.sha256((model_dir / WEIGHTS_FILE).read_bytes())
    tok = json.loads((model_dir / "tokenizer.json").read_text())["model"]
    h.update(json.dumps([tok["vocab"], tok["merges"]], sort_keys=True).encode())
    return h.hexdigest()


def build(spec: ModelSpec, out: Path) -> None:
    from safetensors.numpy import save_file
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tokenizer = _tokenizer(spec)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=CHAT_TEMPLATE
    )
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config.save_pretrained(out)
    # Never end a generation early: tests compare fixed-length greedy outputs.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": fast.bos_token_id, "eos_token_id": None}, indent=2) + "\n"
    )
    save_file(weights(spec, len(fast)), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    fast.save_pretrained(out)


def _tokenizer(spec: ModelSpec):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    return tok


def weights(spec: ModelSpec, vocab: int):  # type: ignore[no-untyped-def]
    """Every tensor of a Llama with ``vocab`` tokens, named as transformers names them, drawn in
    name order from one integer stream."""
    import numpy as np

    h, kv, d, ff = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.head_dim, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    shapes["lm_head.weight"] = (vocab, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (spec.num_heads * d, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, spec.num_heads * d),
            f"{p}.mlp.gate_proj.weight": (ff, h),
            f"{p}.mlp.up_proj.weight": (ff, h),
            f"{p}.mlp.down_proj.weight": (h, ff),
        }
    bits = np.random.PCG64(spec.seed)  # the raw stream is fixed by the algorithm, not the platform
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if "norm" in name:
            out[name] = np.ones(shape, dtype=np.float32)
            continue
        scale = next(s for part, s in spec.scales if part in name)
        # Top 24 bits, centred: integers that float32 holds exactly; the scale is a power of two.
        ints = (bits.random_raw(int(np.prod(shape))) >> np.uint64(40)).astype(np.int64) - (1 << 23)
        out[name] = (ints.astype(np.float32) * np.float32(scale / (1 << 23))).reshape(shape)
    return out
