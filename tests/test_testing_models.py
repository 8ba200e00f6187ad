"""The generated models are fit for equality tests: varied, deterministic, no near-ties."""

import pytest
import torch

from ucm.testing.models import TINY, ensure_model
from ucm.testing.prompts import PROMPTS


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model), AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def greedy(model, ids: torch.Tensor, n: int = 32) -> tuple[list[int], float]:
    out, margin = [], float("inf")
    with torch.no_grad():
        for _ in range(n):
            top = torch.topk(model(ids).logits[0, -1], 2)
            margin = min(margin, (top.values[0] - top.values[1]).item())
            out.append(int(top.indices[0]))
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], 1)
    return out, margin


def test_prompts_have_varied_continuations_without_near_ties(hf_model):
    tok, model = hf_model
    continuations = set()
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids.shape[1] >= 4 * 32
        out, margin = greedy(model, ids)
        assert len(set(out)) >= 8, prompt
        assert margin >= 0.1, prompt
        continuations.add(tuple(out))
    assert len(continuations) == len(PROMPTS)


def test_generation_is_deterministic_and_cached(tiny_model, tmp_path):
    assert ensure_model(TINY) == tiny_model  # cached: same path, no rebuild
    assert (tiny_model / "tokenizer_config.json").exists()
    assert (
        "chat_template" in (tiny_model / "tokenizer_config.json").read_text()
        or (tiny_model / "chat_template.jinja").exists()
    )
