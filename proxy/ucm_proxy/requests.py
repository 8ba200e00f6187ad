"""What the proxy reads from and writes into request bodies: validation with errors naming the
field, the prefill copy, ``kv_transfer_params`` spliced into the client's bytes, the affinity key."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ucm.integration.vllm.chunks import explicit_chunks
from ucm_proxy.errors import ProxyError

# Where the client's prompt chunks are, for Blend (token offsets into a token-id prompt): the proxy
# checks it and hands it to the engine as kv_transfer_params.ucm_chunks, where the connector reads it.
CHUNKS = "ucm_chunks"
MAX_CHUNKS = 1024

# A \uD800-\uDFFF escape: valid JSON, but alone it is no character and cannot be encoded.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes, route: str) -> dict[str, Any]:
    """The request as JSON, checked for what the proxy relies on (the backends check the rest)."""
    if not raw:
        raise ProxyError(400, "Request body is empty; expected a JSON object.")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(400, f"Request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProxyError(400, "Request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "Request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then pay for the check
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ProxyError(400, "Request body has a lone UTF-16 surrogate escape (\\uD800-\\uDFFF).") from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProxyError(400, "'model' is required and must be a non-empty string.", "model")
    if route.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ProxyError(400, "'messages' is required and must be a non-empty list of objects.", "messages")
        for i, message in enumerate(messages):
            _check_content(message.get("content"), f"messages[{i}].content")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise ProxyError(
                400, "'prompt' is required: a string, or a non-empty list of strings or token ids.", "prompt"
            )
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ProxyError(400, "'stream' must be a boolean.", "stream")
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ProxyError(400, f"'{field}' must be a positive integer.", field)
    if "stream_options" in body and body["stream_options"] is not None and not isinstance(body["stream_options"], dict):
        raise ProxyError(400, "'stream_options' must be an object.", "stream_options")
    if "kv_transfer_params" in body and not isinstance(body["kv_transfer_params"], (dict, type(None))):
        raise ProxyError(400, "'kv_transfer_params' must be an object.", "kv_transfer_params")
    if body.get(CHUNKS) is not None:
        _check_chunks(body, route)
    return body


def _check_chunks(body: dict[str, Any], route: str) -> None:
    prompt = body.get("prompt")
    token_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if route.endswith("/chat/completions") or not token_ids:
        raise ProxyError(
            400, f"'{CHUNKS}' gives token offsets: it needs a prompt of token ids (/v1/completions).", CHUNKS
        )
    try:
        explicit_chunks(body[CHUNKS], len(prompt), MAX_CHUNKS, CHUNKS)
    except ValueError as exc:
        raise ProxyError(400, f"{exc}.", CHUNKS) from None


def _engine_params(body: dict[str, Any]) -> dict[str, Any]:
    """What of the client's request the engine's connector reads: its chunk boundaries, if any."""
    return {CHUNKS: body[CHUNKS]} if body.get(CHUNKS) is not None else {}


def _check_content(content: Any, field: str) -> None:
    """A message's content in a shape vLLM takes, as the routing decider reads its text: a string,
    a list of parts (objects, or strings as text), or null (an assistant's message with tool calls)."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ProxyError(400, f"'{field}' must be a string, a list of content parts, or null.", field)
    for j, part in enumerate(content):
        if isinstance(part, str):
            continue
        if not isinstance(part, dict):
            raise ProxyError(400, f"'{field}[{j}]' must be a content part object or a string.", f"{field}[{j}]")
        if "text" in part and not isinstance(part["text"], str):
            raise ProxyError(400, f"'{field}[{j}].text' must be a string.", f"{field}[{j}].text")


# The prefill copy is built from an allowlist: the fields that make the prompt's tokens, and so the
# KV decode will load (found by hashes of those tokens and the cache salt); what schedules the
# request on the engine; and sampling knobs vLLM checks each on its own, so that a bad value is
# refused by prefill before any work rather than by decode after it. Prefill's one token is thrown
# away (decode samples its own): every other field shapes only an output nobody reads, and some are
# refused next to max_tokens=1 or stream=false (min_tokens above 1, stream_options), change what is
# generated (n, use_beam_search) or cost prefill work for nothing (prompt_logprobs, logprobs,
# structured_outputs' grammar). A field not listed here, one vLLM adds later say, goes to decode only.
_PREFILL_COMMON = frozenset(
    {
        "model",
        "cache_salt",
        "add_special_tokens",
        "truncate_prompt_tokens",
        "truncation_side",
        "priority",
        "session_id",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    }
)
COMPLETION_PREFILL_FIELDS = _PREFILL_COMMON | {"prompt", "prompt_embeds", "suffix"}  # suffix: fill-in-the-middle
# What vLLM hands the chat template (tools, tool_choice and response_format too: some templates
# render them into the prompt) and the media the prompt is built from.
CHAT_PREFILL_FIELDS = _PREFILL_COMMON | {
    "messages",
    "tools",
    "tool_choice",
    "response_format",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "reasoning_effort",
    "media_io_kwargs",
    "mm_processor_kwargs",
}


def prefill_body(body: dict[str, Any], route: str) -> bytes:
    """The prefill copy: the allowed fields, one token, not streamed, asking the engine to keep the
    KV for decode."""
    chat = route.endswith("/chat/completions")
    kept = CHAT_PREFILL_FIELDS if chat else COMPLETION_PREFILL_FIELDS
    pbody = {k: v for k, v in body.items() if k in kept}
    pbody["max_tokens"] = 1
    if chat:
        pbody["max_completion_tokens"] = 1  # what vLLM's chat reads first (max_tokens is deprecated there)
    pbody["stream"] = False
    pbody["kv_transfer_params"] = {"do_remote_decode": True, **_engine_params(body)}
    return json.dumps(pbody).encode()


def engine_body(raw: bytes, body: dict[str, Any]) -> bytes:
    """The client's body as an engine that computes the prompt gets it: any ``kv_transfer_params`` it
    carried dropped (only a prefill's answer may tell decode where KV comes from: a client's would
    make decode wait for blocks nobody writes), its ``ucm_chunks`` moved into them."""
    params = _engine_params(body)
    if params:
        return with_params(raw, body, params)
    if "kv_transfer_params" not in body and CHUNKS not in body:
        return raw
    return json.dumps({k: v for k, v in body.items() if k not in ("kv_transfer_params", CHUNKS)}).encode()


def with_params(raw: bytes, body: dict[str, Any], params: Any) -> bytes:
    """The client's body plus kv_transfer_params, spliced in without re-encoding the rest."""
    encoded = json.dumps(params).encode()
    stripped = raw.rstrip()
    if "kv_transfer_params" in body or CHUNKS in body or not stripped.endswith(b"}") or len(body) == 0:
        kept = {k: v for k, v in body.items() if k != CHUNKS}
        return json.dumps({**kept, "kv_transfer_params": params}).encode()
    return stripped[:-1] + b',"kv_transfer_params":' + encoded + b"}"


def prompt_seed(body: dict[str, Any]) -> bytes:
    """What every observable hash of a request's prompt starts from: its model (a LoRA adapter's
    name computes other KV than its base model's) and its ``cache_salt`` (as the proxy forwards it)."""
    salt = body.get("cache_salt")
    seed = [body.get("model"), salt if isinstance(salt, str) and salt else None]
    return hashlib.blake2b(b"ucm-prompt\x00" + json.dumps(seed).encode(), digest_size=12).digest()


def affinity_key(body: dict[str, Any], route: str, chars: int) -> bytes:
    """A digest of the prompt's first ``chars`` characters under its model and cache salt: a routing
    hint (no tokenizer here) that groups a tenant's prompts with its own only, and an adapter's with
    that adapter's only."""
    if route.endswith("/chat/completions"):
        text = json.dumps(body.get("messages"), separators=(",", ":"))[:chars]
    else:
        prompt = body.get("prompt")
        # A list is cut before it is encoded: a long token-id prompt is not copied for a hint.
        text = prompt[:chars] if isinstance(prompt, str) else json.dumps(prompt[:chars])[:chars]
    return hashlib.blake2b(prompt_seed(body) + text.encode(), digest_size=16).digest()


def with_cache_salt(
    raw: bytes, body: dict[str, Any], mode: str, client_key: str | None
) -> tuple[bytes, dict[str, Any]]:
    """The request as the engines should see its ``cache_salt`` (``cache_salt`` in the config):
    ``client`` leaves the client's; ``per_key`` replaces it with one derived from the client's API
    key, so tenants share cached prefixes only with themselves and cannot probe each other's;
    ``none`` removes it (everyone shares)."""
    if mode == "client":
        return raw, body
    out = {k: v for k, v in body.items() if k != "cache_salt"}
    if mode == "per_key" and client_key is not None:
        out["cache_salt"] = hashlib.sha256(b"ucm-tenant\x00" + client_key.encode()).hexdigest()[:32]
    if out == body:
        return raw, body
    return json.dumps(out).encode(), out
