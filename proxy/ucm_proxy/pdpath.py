"""Is disaggregation working? A check of the whole path and a record of the paths requests took.

A PD stack can look healthy — every engine answers ``/health`` — while no request benefits: the
prefill saves nothing (a read-only or full store), decode cannot read the store, or every request
falls back to decode alone. So the proxy checks the path itself: every ``pd_check.interval_s`` it
sends a small request with a prompt no one sent before (a fresh nonce leads it, so no cache holds
any of it) to a prefill backend, then with the ``kv_transfer_params`` it got back to a decode
backend, and reads how many prompt tokens decode took from the store (UCM's connector answers a
PD consumer with ``kv_transfer_params.ucm_loaded_tokens``; vLLM's own ``usage`` reports the
prefill's cached tokens on a decode, so it cannot tell). The reason of a failed check names the
broken hop:

- ``NoPrefill`` / ``NoDecode``: no backend of that pool is available;
- ``ScaledToZero`` (not a failure): discovery finds no pod of a pool at all, so there is no path to
  check; requests that arrive wake the pool (its autoscaler's ``wake-from-zero`` trigger);
- ``Unpaired``: no available decode has the prefills' pairing identity (mid-rollout);
- ``PrefillFailed`` / ``DecodeFailed``: the backend answered an error or not at all;
- ``StoreWritesFailing``: the prefill promised no blocks: its saves to the store fail (or the
  prompt is shorter than one KV block: raise ``pd_check.prompt_words``);
- ``DecodeNotLoading``: decode computed the whole prompt (it cannot read what prefill wrote).

Backends are taken in turn, so one broken pod among many shows within a few checks. Checks do not
count as client traffic (``ucm_proxy_requests_total``) and do not touch backends' passive health.

``RecentPaths`` keeps the paths of the last client requests (``pd``: prefill then decode;
``direct``: decode alone by choice, the prompt short or its prefix stored (``ucm_proxy.decider``);
``fallback``: decode alone because no prefill backend was available; ``decode_only``: a mixed
pool) and, for PD answers the proxy reads whole (not streamed), whether decode loaded the
prompt's KV from the store. Disaggregation is *effective* when most recent requests meant for
prefill went through it and decode loaded what prefill computed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import re
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import aiohttp

from ucm_proxy import metrics
from ucm_proxy.backends import Backend, Pool, other_identities, unpaired
from ucm_proxy.config import PDCheckConfig

logger = logging.getLogger("ucm_proxy.pdpath")

# kv_transfer_params keys of UCM's connector (ucm.integration.vllm.scheduler): what a prefill
# promises, what a decode loaded.
PARAM_BLOCKS = "ucm_blocks"
PARAM_LOADED = "ucm_loaded_tokens"
LOADED_TOKENS = re.compile(rb'"ucm_loaded_tokens"\s*:\s*(\d+)')
# Words for the check's prompt: common English, so any tokenizer spends about a token on each.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be are not an or "
    "have had one all were their there been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way"
)
PATHS = ("pd", "direct", "fallback", "decode_only")
EFFECTIVE_SHARE = 0.5  # of recent requests through prefill, and of PD answers that loaded the KV


@dataclass(frozen=True)
class PathCheck:
    """The result of one check through prefill → store → decode."""

    healthy: bool
    reason: str
    message: str
    at: float  # Unix time
    prefill: str | None = None
    decode: str | None = None


def check_prompt(words: int) -> str:
    """A prompt no cache holds: a random nonce first (block hashes chain, so every block differs)."""
    rng = random.Random(secrets.token_bytes(16))
    return f"UCM disaggregation check {secrets.token_hex(8)}: " + " ".join(rng.choices(_WORDS.split(), k=words))


class Served(Protocol):
    """What the check reads of the proxy (``ucm_proxy.app.Proxy``), as it is when each check runs."""

    prefill: Pool
    decode: Pool
    models: set[str]  # what the backends serve, from the last health round
    session: aiohttp.ClientSession | None
    first_health_round: asyncio.Event


class PathChecker:
    """Runs the check every ``interval_s`` (every few seconds while it fails) and keeps the last."""

    RETRY_S = 5.0

    def __init__(self, proxy: Served, config: PDCheckConfig) -> None:
        self.proxy = proxy
        self.config = config
        self.last: PathCheck | None = None
        self.listeners: list[Callable[[PathCheck], Awaitable[None]]] = []
        self._turn = itertools.count()

    async def run(self) -> None:
        # Start once the first health round has said which backends answer and what they serve.
        await self.proxy.first_health_round.wait()
        while True:
            try:
                result = await self.check()
            except Exception:
                logger.exception("PD path check failed unexpectedly")
                result = PathCheck(False, "CheckFailed", "the check itself failed; see the proxy's log", time.time())
            self._record(result)
            for listener in self.listeners:
                try:
                    await listener(result)
                except Exception:
                    logger.exception("PD path check listener failed")
            interval = self.config.interval_s
            await asyncio.sleep(interval if result.healthy else min(interval, self.RETRY_S))

    def _record(self, result: PathCheck) -> None:
        if self.last is None or (self.last.healthy, self.last.reason) != (result.healthy, result.reason):
            log = logger.info if result.healthy else logger.warning
            log("PD path %s: %s: %s", "healthy" if result.healthy else "broken", result.reason, result.message)
        self.last = result
        metrics.PD_PATH_HEALTHY.set(1 if result.healthy else 0)
        metrics.PD_PATH_CHECKS.labels(result.reason).inc()

    async def check(self) -> PathCheck:
        proxy, now, turn = self.proxy, time.time(), next(self._turn)
        idle = [pool.role for pool in (proxy.prefill, proxy.decode) if pool.at_zero]
        if idle:
            message = f"the {' and '.join(idle)} pool has no pods (scaled to zero): nothing to check until one starts"
            return PathCheck(True, "ScaledToZero", message, now)
        prefill = _in_turn(proxy.prefill, turn, unpaired(proxy.prefill, proxy.decode))
        if prefill is None and proxy.prefill.available():
            message = "no available decode shares a configuration with the available prefills (a rollout?)"
            return PathCheck(False, "Unpaired", message, now)
        if prefill is None:
            return PathCheck(False, "NoPrefill", "no prefill backend is available", now)
        decode = _in_turn(proxy.decode, turn, other_identities(proxy.decode, prefill.identity))
        if decode is None:
            return PathCheck(False, "NoDecode", "no decode backend is available", now, prefill.url)
        if not proxy.models:
            return PathCheck(False, "NoModel", "no backend has named its model yet", now, prefill.url, decode.url)
        body: dict[str, Any] = {"model": proxy.models.base(), "prompt": check_prompt(self.config.prompt_words)}
        body.update(max_tokens=1, temperature=0, stream=False)
        sides = prefill.url, decode.url

        async def post(backend: Backend, payload: dict[str, Any]) -> tuple[int, Any]:
            assert proxy.session is not None
            timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
            headers = {"Content-Type": "application/json", "X-Request-Id": f"ucm-pd-check-{secrets.token_hex(6)}"}
            async with proxy.session.post(
                backend.url + "/v1/completions", data=json.dumps(payload), headers=headers, timeout=timeout
            ) as r:
                return r.status, json.loads(await r.read())

        try:
            status, answer = await post(prefill, {**body, "kv_transfer_params": {"do_remote_decode": True}})
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return PathCheck(False, "PrefillFailed", f"prefill {prefill.url}: {_describe(exc)}", now, *sides)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if status != 200 or not isinstance(params, dict):
            what = f"answered {status}" if status != 200 else "returned no kv_transfer_params (is the connector on?)"
            return PathCheck(False, "PrefillFailed", f"prefill {prefill.url} {what}", now, *sides)
        promised = params.get(PARAM_BLOCKS)
        if not isinstance(promised, int) or promised <= 0:
            return PathCheck(
                False,
                "StoreWritesFailing",
                f"the store is not taking prefill {prefill.url}'s blocks: it promised none, so its saves are "
                f"failing (or the check's {self.config.prompt_words}-word prompt is shorter than a block)",
                now,
                *sides,
            )
        try:
            status, answer = await post(decode, {**body, "kv_transfer_params": params})
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return PathCheck(False, "DecodeFailed", f"decode {decode.url}: {_describe(exc)}", now, *sides)
        if status != 200 or not isinstance(answer, dict):
            return PathCheck(False, "DecodeFailed", f"decode {decode.url} answered {status}", now, *sides)
        loaded = (answer.get("kv_transfer_params") or {}).get(PARAM_LOADED)
        if not isinstance(loaded, int):
            message = f"decode {decode.url} did not say what it loaded (is it a UCM connector consumer?)"
            return PathCheck(False, "DecodeNotLoading", message, now, *sides)
        if loaded <= 0:
            return PathCheck(
                False,
                "DecodeNotLoading",
                f"decode {decode.url} computed the whole prompt: it did not load the {promised} blocks "
                f"prefill {prefill.url} saved (is the store reachable from decode?)",
                now,
                *sides,
            )
        took = time.time() - now
        message = f"{prefill.url} → store → {decode.url}: {promised} blocks, {loaded} tokens loaded, {took:.2f} s"
        return PathCheck(True, "Healthy", message, now, *sides)


def _in_turn(pool: Pool, turn: int, avoid: frozenset[str]) -> Backend | None:
    candidates = pool.available(avoid)
    return candidates[turn % len(candidates)] if candidates else None


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class RecentPaths:
    """The paths of the last ``size`` client requests, and whether decode loaded the KV of the
    last ``size`` PD answers the proxy read whole."""

    def __init__(self, size: int = 200) -> None:
        self.paths: deque[str] = deque(maxlen=size)
        self.loaded: deque[bool] = deque(maxlen=size)

    def record(self, path: str) -> None:
        self.paths.append(path)

    def record_decode(self, promised: int, answer: bytes) -> None:
        """A PD answer: did decode load any of the prompt from the store?"""
        if promised <= 0:
            return  # nothing was saved for it (a prompt shorter than a block): no evidence
        found = LOADED_TOKENS.search(answer)
        if found is None:
            return  # not UCM's connector: no evidence
        loaded = int(found.group(1)) > 0
        self.loaded.append(loaded)
        metrics.PD_DECODE_KV.labels("loaded" if loaded else "recomputed").inc()

    def effective(self, check: PathCheck | None) -> tuple[bool | None, str, str]:
        """(effective, reason, message); None when there is nothing to judge yet."""
        if not self.paths:
            return None, "NoTraffic", "no client requests yet"
        counts = {p: self.paths.count(p) for p in PATHS}
        meant = counts["pd"] + counts["fallback"] + counts["decode_only"]
        if not meant:
            return None, "AllDirect", f"the last {len(self.paths)} requests were short or stored: decode served them"
        seen = f"{counts['pd']} of the last {meant} requests meant for prefill went through it"
        if counts["direct"]:
            seen += f" ({counts['direct']} more were short or stored and went straight to decode)"
        if counts["pd"] / meant < EFFECTIVE_SHARE:
            return False, "NotDisaggregated", f"{seen} ({counts['fallback']} fell back to decode alone)"
        if self.loaded:
            loaded = sum(self.loaded) / len(self.loaded)
            loads = f"decode loaded the prompt's KV in {sum(self.loaded)} of the last {len(self.loaded)} PD answers"
            if loaded < EFFECTIVE_SHARE:
                return False, "DecodeRecomputing", f"{seen}; {loads}"
            return True, "Disaggregated", f"{seen}; {loads}"
        if check is not None and not check.healthy:
            return False, check.reason, f"{seen}; the last path check failed: {check.message}"
        return True, "Disaggregated", seen

    def report(self, check: PathCheck | None) -> dict[str, Any]:
        """What ``GET /pd-path`` answers and the proxy writes into its resource's status."""
        effective, reason, message = self.effective(check)
        return {
            "check": asdict(check) if check is not None else None,
            "effective": {"value": effective, "reason": reason, "message": message},
            "paths": {p: self.paths.count(p) for p in PATHS},
        }
