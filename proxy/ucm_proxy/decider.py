"""Selective disaggregation: per request, prefill on a prefill engine (``pd``) or send the request
straight to decode (``direct``).

A prefill round trip pays when decode would otherwise compute many prompt tokens itself. It does
not for a short prompt, nor for one whose prefix is already in the store (decode's connector loads
it — as it would have loaded prefill's blocks). The proxy estimates both without a tokenizer:

- length: token ids are counted; text is ``chars / chars_per_token`` (the proxy has no model);
- stored prefix: the proxy remembers the prompts it served, as a chain of hashes over fixed-size
  chunks (``CHUNK_TOKENS`` estimated tokens each; each hash covers everything before it, like the
  connector's block hashes). The leading chunks of a new prompt found there were stored by an
  earlier request — prefill saved them, or decode did while computing them.

A cold prompt still goes straight to decode while prefill is the busier pool by ``balance_gap``
requests or more (the least loaded engine of each, as engines report it): a burst of new
conversations is then split across both pools instead of queueing on prefill while decode idles.

Both are estimates and err one way: a prefix evicted from the store since, or a proxy replica that
did not see the earlier request, costs decode a recompute (slower, never wrong tokens); a proxy
that restarts remembers nothing and disaggregates until it has seen traffic again. Measured cost:
``benchmarks/proxy_overhead.py`` (``decide_us``).
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ucm_proxy.requests import prompt_seed

CHUNK_TOKENS = 64
_SEP = "\x1e"  # between chat messages, so [a, bc] and [ab, c] are different prompts


@dataclass(frozen=True)
class Decision:
    disaggregate: bool
    # cold: prefill it; short: decode computes it; stored: decode loads its prefix; balance: cold, but
    # decode is idle enough to compute it sooner than a queueing prefill
    reason: str
    tokens: int  # estimated prompt tokens
    stored: int  # of which estimated to be in the store already


def prompt_chunks(body: dict[str, Any], route: str, chars_per_token: float) -> tuple[list[bytes], int]:
    """The prompt's whole chunks of ``CHUNK_TOKENS`` estimated tokens (a partial last chunk is no
    full block in the store either), and its estimated token count."""
    if route.endswith("/chat/completions"):
        text = _SEP.join(f"{m.get('role')}:{_content(m.get('content'))}" for m in body["messages"])
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            # Token ids; strings (TypeError) or ids beyond 64 bits (vLLM refuses them) hash as text.
            with contextlib.suppress(TypeError, OverflowError):
                ids = array("q", prompt).tobytes()
                size = CHUNK_TOKENS * 8
                return [ids[i : i + size] for i in range(0, len(ids) - len(ids) % size, size)], len(prompt)
        text = prompt if isinstance(prompt, str) else _SEP.join(map(str, prompt))
    size = max(1, round(CHUNK_TOKENS * chars_per_token))
    whole = len(text) - len(text) % size
    return [text[i : i + size].encode() for i in range(0, whole, size)], round(len(text) / chars_per_token)


def _content(content: Any) -> str:
    """A message's text, its content as ``requests.parse_body`` lets it through."""
    if isinstance(content, list):  # parts: the text ones make the prompt (a string part is text)
        return "".join(p if isinstance(p, str) else p.get("text", "") for p in content)
    return content if isinstance(content, str) else ""


class Decider:
    def __init__(self, min_prefill_tokens: int, chars_per_token: float, remembered: int, balance_gap: float) -> None:
        self.min_prefill_tokens = min_prefill_tokens
        self.balance_gap = balance_gap
        self.chars_per_token = chars_per_token
        self.remembered = remembered
        self._chunks: OrderedDict[bytes, None] = OrderedDict()  # chained chunk hashes, LRU

    def decide(
        self, body: dict[str, Any], route: str, pools_gap: Callable[[], float] | None = None
    ) -> tuple[Decision, list[bytes]]:
        """The decision, and the prompt's chained chunk hashes (for :meth:`remember`). ``pools_gap``:
        the least loaded prefill engine's load less the least loaded decode engine's, asked only
        when a cold prompt might go to decode for balance."""
        if self.min_prefill_tokens == 0:
            return Decision(True, "cold", 0, 0), []
        chunks, tokens = prompt_chunks(body, route, self.chars_per_token)
        # The chain starts from the request's model and cache salt, as the engines' block hashes start
        # from its adapter and salt: a tenant's prompt matches only what was served under its own
        # salt, so decisions (and the counters that count them) reveal nothing of another tenant's
        # prompts; an adapter's prompt only what that adapter computed.
        hashes, h = [], prompt_seed(body)
        for chunk in chunks:
            h = hashlib.blake2b(h + chunk, digest_size=12).digest()
            hashes.append(h)
        known = 0
        for h in hashes:
            if h not in self._chunks:
                break
            known += 1
        stored = min(tokens, known * CHUNK_TOKENS)
        if tokens < self.min_prefill_tokens:
            return Decision(False, "short", tokens, stored), hashes
        if tokens - stored < self.min_prefill_tokens:
            return Decision(False, "stored", tokens, stored), hashes
        if self.balance_gap and pools_gap is not None and pools_gap() >= self.balance_gap:
            return Decision(False, "balance", tokens, stored), hashes
        return Decision(True, "cold", tokens, stored), hashes

    def remember(self, hashes: list[bytes]) -> None:
        """A request was served: its prompt's whole chunks are in the store now (prefill or decode
        saved them)."""
        if self.remembered == 0:
            return
        for h in hashes:
            self._chunks[h] = None
            self._chunks.move_to_end(h)
        while len(self._chunks) > self.remembered:
            self._chunks.popitem(last=False)
