"""The demo model is the same bytes on every machine and fit for equality tests: varied greedy
continuations that depend on the whole prompt, with no near-ties."""

import pytest
import torch

from ucm.deploy.demo_model import TINY, build, digest, ensure_model
from ucm_testing.prompts import PROMPTS

# sha256 of the tiny model's weights file + tokenizer vocabulary and merges. The recipe uses no float
# arithmetic that could differ between CPUs; if this fails, the recipe (or a library it relies on)
# changed, and every test comparing outputs rests on a model nobody checked: re-check the margins.
TINY_DIGEST = "f3f70cf96fe40e2d3bfa9b66531bde827f6c169e7f07fb58c6eeed1b95a97496"


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


def test_model_bytes_are_pinned(tiny_model):
    assert digest(tiny_model) == TINY_DIGEST


def test_a_rebuild_gives_the_same_bytes(tmp_path):
    build(TINY, tmp_path)
    assert digest(tmp_path) == TINY_DIGEST


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


def test_continuations_depend_on_the_first_blocks(hf_model):
    """A wrong KV block far back in the prompt must change the answer, or equality tests of KV
    reuse prove nothing."""
    tok, model = hf_model
    encoded = [tok(p, return_tensors="pt").input_ids for p in PROMPTS]
    for i, ids in enumerate(encoded):
        other = encoded[(i + 1) % len(encoded)]
        swapped = torch.cat([other[:, :64], ids[:, 64:]], 1)  # first two blocks from another prompt
        assert greedy(model, swapped, 8)[0] != greedy(model, ids, 8)[0], PROMPTS[i]


def test_generation_is_cached(tiny_model):
    assert ensure_model(TINY) == tiny_model  # cached: same path, no rebuild
    assert (tiny_model / "tokenizer_config.json").exists()
    assert (
        "chat_template" in (tiny_model / "tokenizer_config.json").read_text()
        or (tiny_model / "chat_template.jinja").exists()
    )
