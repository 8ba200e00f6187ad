"""The prefill copy of a request (``requests.prefill_body``): what a prefill engine is asked to do."""

import json

import pytest

from ucm_proxy.requests import prefill_body
from ucm_testing.fake_vllm import MODEL

# A client's requests as vLLM accepts them, each with fields that make no sense for one token.
COMPLETION = {
    "model": MODEL,
    "prompt": "Once upon a time",
    "max_tokens": 64,
    "min_tokens": 8,
    "logprobs": 3,
    "echo": True,
    "n": 2,
    "stop": ["\n"],
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.7,
    "seed": 1,
    "cache_salt": "tenant-a",
    "truncate_prompt_tokens": 100,
    "add_special_tokens": False,
    "priority": 2,
    "user": "someone",
}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "max_completion_tokens": 64,
    "min_tokens": 8,
    "logprobs": True,
    "top_logprobs": 2,
    "n": 2,
    "stop": "\n",
    "stream": True,
    "stream_options": {"include_usage": True},
    "top_p": 0.9,
    "tools": [TOOL],
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": True,
    "response_format": {"type": "json_object"},
    "cache_salt": "tenant-a",
    "kv_transfer_params": {"do_remote_prefill": True},
}


def test_the_completion_prefill_copy_keeps_what_shapes_the_prompt_only():
    pre = json.loads(prefill_body(COMPLETION, "/v1/completions"))
    assert pre == {
        "model": MODEL,
        "prompt": "Once upon a time",
        "cache_salt": "tenant-a",  # part of the block hashes decode looks the KV up by
        "truncate_prompt_tokens": 100,
        "add_special_tokens": False,
        "priority": 2,
        "temperature": 0.7,
        "seed": 1,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }


def test_the_chat_prefill_copy_keeps_the_template_inputs():
    pre = json.loads(prefill_body(CHAT, "/v1/chat/completions"))
    assert pre == {
        "model": MODEL,
        "messages": CHAT["messages"],
        "tools": [TOOL],  # rendered into the prompt by the chat template
        "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "response_format": {"type": "json_object"},
        "cache_salt": "tenant-a",
        "top_p": 0.9,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},  # the client's own never reaches an engine
    }


@pytest.mark.parametrize(("route", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_vllm_accepts_the_prefill_copy_of_a_request_it_accepts(route, body):
    """Through vLLM's own request models and sampling checks (a min_tokens above one token was
    refused: PD requests with it got a 400 from prefill)."""
    if route.endswith("/chat/completions"):
        protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
        request_type = protocol.ChatCompletionRequest
    else:
        protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
        request_type = protocol.CompletionRequest
    client = request_type.model_validate(json.loads(json.dumps(body)))
    client.to_sampling_params(64, {})  # the client's request is valid as it stands
    prefill = request_type.model_validate(json.loads(prefill_body(body, route)))
    params = prefill.to_sampling_params(1, {})
    assert (params.max_tokens, params.n, params.min_tokens, params.logprobs) == (1, 1, 0, None)
