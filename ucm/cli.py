"""The ``ucm`` command: store administration, the engines' entrypoint (``ucm serve``), the local
stack (``ucm up`` / ``ucm down``) and the objects the operator would create (``ucm render``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from ucm.config import ConfigError, load_mapping
from ucm.deploy.render import add_parser as add_render_parser
from ucm.deploy.up import add_parsers as add_up_parsers
from ucm.store import StoreError, create_store


def _load_store_config(path: str) -> dict[str, Any]:
    """A store configuration file, any UCM config file with a ``store`` section, or an engine's
    kv-transfer-config (read as ``ucm serve --kv-config`` reads it, ``${VAR}``s filled in)."""
    data = load_mapping(path, "--config", "a mapping with 'spec' and per-stage options")
    if "kv_connector_extra_config" in data:
        from ucm.integration.vllm.config import scheduler_store_config
        from ucm.serve import load_kv_config

        # A lookup-only client, as the engines' scheduler runs: no Mooncake segment joins the pool.
        return scheduler_store_config(load_kv_config(path)["kv_connector_extra_config"]["store"])
    if isinstance(data.get("store"), dict):
        data = data["store"]
    return data


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _store_stats(store: Any) -> dict[str, Any]:
    count = total = 0
    oldest = newest = None
    for info in store.scan():
        count += 1
        total += info.size
        oldest = info.mtime if oldest is None else min(oldest, info.mtime)
        newest = info.mtime if newest is None else max(newest, info.mtime)
    return {"blocks": count, "bytes": total, "oldest_use": oldest, "newest_use": newest}


def cmd_store(args: argparse.Namespace) -> int:
    store = create_store(_load_store_config(args.config))
    try:
        if args.action == "stats":
            result = _store_stats(store)
            text = f"blocks: {result['blocks']}\nbytes:  {result['bytes']} ({_human(result['bytes'])})"
            code = 0
        elif args.action == "verify":
            corrupt = store.verify(repair=args.repair)
            checked = _store_stats(store)["blocks"] + (len(corrupt) if args.repair else 0)
            result = {"checked": checked, "corrupt": [c.hex() for c in corrupt], "repaired": args.repair}
            lines = [f"checked {checked} blocks: {len(corrupt)} corrupt" + (" (removed)" if args.repair else "")]
            lines += [f"  {c.hex()}" for c in corrupt]
            text = "\n".join(lines)
            code = 1 if corrupt and not args.repair else 0
        else:
            blocks, freed = store.gc(args.target)
            remaining = _store_stats(store)
            result = {"evicted_blocks": blocks, "evicted_bytes": freed, **remaining}
            text = (
                f"evicted {blocks} blocks ({_human(freed)}); "
                f"{remaining['blocks']} blocks ({_human(remaining['bytes'])}) remain"
            )
            code = 0
    finally:
        store.close()
    print(json.dumps(result) if args.json else text)
    return code


def _byte_size(text: str) -> int:
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"expected a size such as 500GiB or 1000000, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ucm", description="Unified Cache Management")
    sub = parser.add_subparsers(dest="command", required=True)
    store = sub.add_parser("store", help="inspect and maintain a KV block store")
    actions = store.add_subparsers(dest="action", required=True)
    for name, help_text in (
        ("stats", "count blocks and bytes"),
        ("verify", "check every block's checksum; exit 1 when corrupt blocks are found"),
        ("gc", "evict least-recently-used blocks down to a target size"),
    ):
        p = actions.add_parser(name, help=help_text)
        p.add_argument(
            "--config",
            "-c",
            required=True,
            help="store config (YAML/JSON), a file with a 'store' section, or an engine's kv-transfer-config",
        )
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "verify":
            p.add_argument("--repair", action="store_true", help="remove corrupt blocks")
        if name == "gc":
            p.add_argument("--target", type=_byte_size, required=True, help="size to shrink to, e.g. 500GiB")
    store.set_defaults(func=cmd_store)
    serve = sub.add_parser("serve", help="start a vLLM server with UCMConnector (the engines' entrypoint)")
    serve.add_argument("--kv-config", required=True, help="kv-transfer-config JSON file (may use ${VAR}s)")
    serve.add_argument("--dry-run", action="store_true", help="check everything, print the vLLM command, exit")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then the vLLM server arguments")
    serve.set_defaults(func=cmd_serve)
    config = sub.add_parser("config", help="UCM-style configuration")
    config_actions = config.add_subparsers(dest="action", required=True)
    convert = config_actions.add_parser(
        "convert", help="print ours for a UCM-style ucm_config.yaml or kv-transfer-config (migrate once)"
    )
    convert.add_argument("file", help="ucm_config.yaml, or a kv-transfer-config JSON/YAML")
    convert.add_argument(
        "--to",
        choices=("kv-config", "resource"),
        default="kv-config",
        help="kv-config: the file `ucm serve --kv-config` takes (default); resource: spec.store and spec.sparse "
        "of a UCMDeployment",
    )
    convert.set_defaults(func=cmd_config)
    add_up_parsers(sub)
    add_render_parser(sub)
    return parser


def cmd_config(args: argparse.Namespace) -> int:
    from ucm.deploy.convert import convert

    print(convert(args.file, args.to))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ucm.serve import serve

    vllm_args = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    return serve(args.kv_config, vllm_args, dry_run=args.dry_run)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, StoreError) as exc:
        print(f"ucm: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`ucm render ... | head`): nothing to say, and nothing more to flush to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a process killed by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
