"""Small Llama models generated offline, deterministically, for tests, benchmarks and `ucm up`.

No model hub is reachable from CI, so models are made here: a byte-level BPE tokenizer trained on
a fixed text, and a Llama-architecture model briefly trained on the same text so that greedy
continuations are varied (random weights repeat one token, which makes equality tests weak).
Everything is seeded; the result is cached under ``~/.cache/ucm/models/<name>-<fingerprint>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

# A fixed corpus: varied sentences so the trained model's continuations vary too.
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


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    train_steps: int
    train_batch: int = 16
    max_position_embeddings: int = 4096
    seed: int = 1234
    version: int = 1  # bump when the recipe changes: the cache key changes with it

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
    train_steps=300,
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
    train_steps=20,
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
        _build(spec, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise  # someone else won the race only if the target is complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(spec: ModelSpec, out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=CHAT_TEMPLATE
    )

    torch.manual_seed(spec.seed)
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
    model = LlamaForCausalLM(config)
    ids = torch.tensor(fast(CORPUS)["input_ids"])
    _train(model, ids, spec)
    model.eval()
    # Never end a generation early: tests compare fixed-length greedy outputs.
    model.generation_config.eos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)


def _train(model, ids, spec: ModelSpec) -> None:  # type: ignore[no-untyped-def]
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3 if spec.hidden_size <= 256 else 1e-3)
    seq, batch = 64, spec.train_batch
    for _ in range(spec.train_steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
