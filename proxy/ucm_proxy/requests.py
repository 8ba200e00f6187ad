"""What the proxy reads from and writes into request bodies: validation with errors naming the
field, the prefill copy, ``kv_transfer_params`` spliced into the client's bytes, the affinity key."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ucm_proxy.errors import ProxyError

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
    return body


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill copy: one token, not streamed, asking the engine to keep the KV for decode."""
    pbody = dict(body)
    pbody["max_tokens"] = 1
    if "max_completion_tokens" in pbody:
        pbody["max_completion_tokens"] = 1
    pbody["stream"] = False
    pbody.pop("stream_options", None)
    pbody["kv_transfer_params"] = {"do_remote_decode": True}
    return json.dumps(pbody).encode()


def without_params(raw: bytes, body: dict[str, Any]) -> bytes:
    """The client's body, minus any ``kv_transfer_params`` it carried: only a prefill's answer may
    tell decode where KV comes from (a client's would make decode wait for blocks nobody writes)."""
    if "kv_transfer_params" not in body:
        return raw
    return json.dumps({k: v for k, v in body.items() if k != "kv_transfer_params"}).encode()


def with_params(raw: bytes, body: dict[str, Any], params: Any) -> bytes:
    """The client's body plus kv_transfer_params, spliced in without re-encoding the rest."""
    encoded = json.dumps(params).encode()
    stripped = raw.rstrip()
    if "kv_transfer_params" in body or not stripped.endswith(b"}") or len(body) == 0:
        return json.dumps({**body, "kv_transfer_params": params}).encode()
    return stripped[:-1] + b',"kv_transfer_params":' + encoded + b"}"


def affinity_key(body: dict[str, Any], route: str, chars: int) -> bytes:
    """A digest of the prompt's first ``chars`` characters: a routing hint (no tokenizer here)."""
    if route.endswith("/chat/completions"):
        text = json.dumps(body.get("messages"), separators=(",", ":"))[:chars]
    else:
        prompt = body.get("prompt")
        # A list is cut before it is encoded: a long token-id prompt is not copied for a hint.
        text = prompt[:chars] if isinstance(prompt, str) else json.dumps(prompt[:chars])[:chars]
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


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
