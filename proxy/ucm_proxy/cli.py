"""``ucm-proxy``: flags and/or a YAML file; flags win over the file."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence
from typing import Any, get_args

from pydantic import BaseModel

from ucm.config import ConfigError, load_mapping, parse_config
from ucm_proxy.config import Policy, ProxyConfig, RoutingConfig
from ucm_proxy.keys import read_keys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ucm-proxy", description="OpenAI-compatible prefill/decode proxy for vLLM")
    p.add_argument("--config", "-c", help="YAML file with any of the options below (and more: routing, health...)")
    p.add_argument("--host", help=f"address to listen on (config: host; default {_default('host')})")
    p.add_argument("--port", type=int, help=f"port to listen on (config: port; default {_default('port')})")
    p.add_argument(
        "--mode",
        choices=["pd", "mixed"],
        help="pd: prefill then decode; mixed: every backend serves whole requests "
        f"(config: mode; default {_default('mode')})",
    )
    p.add_argument("--prefill", action="append", metavar="URL", help="prefill backend (repeatable)")
    p.add_argument("--decode", action="append", metavar="URL", help="decode backend (repeatable)")
    p.add_argument(
        "--prefill-policy",
        choices=get_args(Policy),
        help="how a prefill backend is chosen (config: routing.prefill; default "
        f"{_default('prefill', RoutingConfig)}, kv_aware with routing.kv_events)",
    )
    p.add_argument(
        "--decode-policy",
        choices=get_args(Policy),
        help="how a decode (or mixed) backend is chosen (config: routing.decode; default "
        f"{_default('decode', RoutingConfig)}, kv_aware in mode mixed with routing.kv_events)",
    )
    p.add_argument(
        "--retries",
        type=int,
        help=f"extra attempts on another backend per request phase (config: retries; default {_default('retries')})",
    )
    p.add_argument(
        "--fallback-to-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pd: with no prefill backend, let decode do it all (config: fallback_to_decode; "
        "--no-fallback-to-decode turns off what the config file turns on)",
    )
    p.add_argument("--api-keys-file", help="file with one accepted API key per line")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        help=f"larger request bodies get 413 (config: max_body_bytes; default {_default('max_body_bytes')})",
    )
    p.add_argument(
        "--min-prefill-tokens",
        type=int,
        help="pd: prefill remotely only prompts with about this many tokens not yet stored (0: every request)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="less severe log records are dropped (the proxy's and uvicorn's)",
    )
    p.add_argument(
        "--check", action="store_true", help="validate the configuration (not the files it names), print it, exit"
    )
    return p


def _default(name: str, model: type[BaseModel] = ProxyConfig) -> Any:
    """A config field's default, for the help of the flag that overrides it."""
    return model.model_fields[name].default


def load_config(args: argparse.Namespace) -> ProxyConfig:
    data: dict[str, Any] = load_mapping(args.config, "--config") if args.config else {}
    flags = {
        "host": args.host,
        "port": args.port,
        "mode": args.mode,
        "prefill": args.prefill,
        "decode": args.decode,
        "retries": args.retries,
        "fallback_to_decode": args.fallback_to_decode,
        "api_keys_file": args.api_keys_file,
        "max_body_bytes": args.max_body_bytes,
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    routing = dict(data.get("routing") or {})
    if args.prefill_policy:
        routing["prefill"] = args.prefill_policy
    if args.decode_policy:
        routing["decode"] = args.decode_policy
    if routing:
        data["routing"] = routing
    if args.min_prefill_tokens is not None:
        data["disaggregation"] = {**(data.get("disaggregation") or {}), "min_prefill_tokens": args.min_prefill_tokens}
    return parse_config(ProxyConfig, data, "proxy")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
        if args.check:
            print(config.model_dump_json(indent=2))
            return 0
        # A key file that holds nothing is a mistake at startup (unreadable: OSError); while serving,
        # it refuses everyone (ucm_proxy.keys).
        for field, path, what in (
            ("api_keys_file", config.api_keys_file, "key"),
            ("metrics_token_file", config.metrics_token_file, "token"),
        ):
            if path is not None and not read_keys(path):
                raise ConfigError(f"{field}: {path} holds no {what}")
        config.backend_key()
    except (ConfigError, OSError) as exc:
        print(f"ucm-proxy: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from ucm_proxy.app import create_app
    from ucm_proxy.server import uvicorn_config

    server = uvicorn.Server(uvicorn_config(create_app(config), args.log_level))
    tune_gc()
    server.run()
    return 0


def tune_gc() -> None:
    """Fewer, cheaper cyclic collections: with the default threshold (700) the in-flight requests'
    objects alone trigger a young collection every few requests, and each full one walks every
    module's objects (~30 ms here). The objects that exist once the app is built are frozen out of
    collection, and young collections start at 20,000 net new objects — about 5% of the CPU per
    streamed request (benchmarks/proxy_overhead.py). Cycles are still collected: a young collection
    every few thousand requests there."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


if __name__ == "__main__":
    sys.exit(main())
