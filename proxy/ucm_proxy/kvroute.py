"""What ``kv_aware`` routing needs per request: the prompt's tokens and each engine's cached prefix.

The proxy has no tokenizer (nor the chat template): it asks an engine of the pool (vLLM's
``/tokenize``, which renders chat messages as ``/v1/chat/completions`` does), only when some engine
or the store has announced blocks — a pool with no events pays nothing. A prompt given as token ids
needs no call.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from ucm_proxy import metrics
from ucm_proxy.backends import Pool
from ucm_proxy.kvevents import Followers

# The fields of a chat request that shape its rendered prompt, as vLLM's /tokenize takes them.
_CHAT_TOKENIZE_FIELDS = (
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
)


class KVRouter:
    def __init__(
        self, followers: Followers, session: aiohttp.ClientSession, timeout_s: float, store_weight: float
    ) -> None:
        self.followers = followers
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.store_weight = store_weight

    async def hits(
        self, pool: Pool, route: str, body: dict[str, Any], adapter: str | None = None
    ) -> dict[str, float] | None:
        """Per available engine of ``pool``, the prompt tokens it would not compute: those its own
        cache holds, plus ``store_weight`` for each further one the store holds (a load, not free);
        None when nothing is known. ``adapter``: the LoRA adapter the request runs (None: the base
        model), whose blocks alone it can use."""
        index = self.followers.index
        available = pool.available()
        urls = [b.url for b in available]
        if not urls:  # the pool waits for a backend first; the pick after that weighs load alone
            return None
        if not index.knows(urls):
            metrics.child(metrics.KV_ROUTING, "no_index").inc()
            return None
        tokens = await self.tokens(min(available, key=lambda b: b.load).url, route, body)
        if tokens is None:
            metrics.child(metrics.KV_ROUTING, "no_tokens").inc()
            return None
        salt = body.get("cache_salt")
        cached = index.cached(urls, tokens, salt if isinstance(salt, str) else None, adapter)
        return {url: own + self.store_weight * (reach - own) for url, (own, reach) in cached.items()}

    async def tokens(self, url: str, route: str, body: dict[str, Any]) -> list[int] | None:
        if route.endswith("/chat/completions"):
            request = {k: body[k] for k in _CHAT_TOKENIZE_FIELDS if k in body}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str) or "suffix" in body:
                return None  # a batch of prompts, or fill-in-the-middle: no one prefix to route by
            request = {k: body[k] for k in ("model", "prompt", "add_special_tokens") if k in body}
        try:
            async with self.session.post(url + "/tokenize", json=request, timeout=self.timeout) as r:
                if r.status != 200:
                    return None
                tokens = (await r.json()).get("tokens")
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            return None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens
