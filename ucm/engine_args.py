"""Which vLLM options a spec's extra arguments set, read as the engine's own parser reads them.

A policy that compares strings is bypassed by the spellings vLLM accepts: ``--trust_remote_code``,
an abbreviation (``--trust-remote``), a dotted sub-key (``--kv-transfer-config.kv_connector=x``),
``-O3``, a short option with its value attached. The operator's image carries no vLLM (nor torch),
so this module does what vLLM's server parser does, from a table of that parser's options
(``ucm.vllm_options``, generated from vLLM: ``python -m ucm.engine_args``): first
what ``FlexibleArgumentParser.parse_args`` rewrites, then how argparse reads each resulting string.
``tests/deploy/test_engine_args.py`` holds it to vLLM's real parser on generated spellings.

An argument is reduced to the options it sets, by argparse ``dest`` (``trust_remote_code`` for
``--trust-remote-code`` and ``--no-trust-remote-code`` alike). An argument vLLM would read as an
option it does not have, or as an abbreviation of several, is an error here: the engine would not
start with it, and a vLLM other than the table's must not be a way around the policy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ucm.vllm_options import OPTIONS, SWITCHES, VLLM_VERSION


class EngineArgError(ValueError):
    """An argument vLLM would not read as known options."""


def dests(arg: str) -> list[str]:
    """The options (argparse ``dest``) vLLM's server parser sets from ``arg``, one extra argument;
    none for a value. Raises :class:`EngineArgError` for one it would not read."""
    if arg == "--":
        raise EngineArgError("-- ends vLLM's options: the deployment's own arguments after it would not be read")
    try:
        # A dotted option (--x.key=value, --x.key value) is folded into one "--x <JSON>" at the end.
        # (Without "=" it takes the next argument as its value, whatever it looks like: that argument
        # is read on its own here too, so this reads more than vLLM there, never less.)
        return [dest for token in _rewritten(arg) for dest in _read(_dotted_key(token))]
    except EngineArgError as exc:
        raise EngineArgError(f"{arg.partition('=')[0]} {exc}") from None


def setting(args: list[str], dest: str) -> list[tuple[int, str]]:
    """The ``(index, argument)`` of each of ``args`` that sets the option ``dest``; arguments vLLM
    would not read are passed over (the policy, or vLLM itself, names those)."""
    found = []
    for i, arg in enumerate(args):
        try:
            if dest in dests(arg):
                found.append((i, arg))
        except EngineArgError:
            continue
    return found


def turns_off(arg: str) -> bool:
    """Whether ``arg`` is a switch's negative form (``--no-x``, ``--no_x``), as vLLM spells it."""
    return _rewritten(arg)[0].startswith("--no-")


def _rewritten(arg: str) -> list[str]:
    """The strings ``FlexibleArgumentParser.parse_args`` makes of ``arg`` before it folds dotted
    options into JSON values."""
    if arg.startswith("--"):
        # Underscores become dashes in the name: up to the "=" and the first ".".
        key, sep, value = arg.partition("=")
        name, dot, sub = key[2:].partition(".")
        return ["--" + name.replace("_", "-") + dot + sub + sep + value]
    if arg.startswith("-O"):
        # -O3, -O=3, -O 3: the optimization level, and what follows -O as a string of its own.
        return ["--optimization-level"] if arg == "-O" else ["--optimization-level", arg[3 if arg[2] == "=" else 2 :]]
    return [arg]


def json_keys(arg: str, following: str | None) -> set[str]:
    """The top-level keys ``arg`` sets in the JSON value of the option it names (as
    ``--compilation-config``): a dotted sub-key (``-cc.backend=x``, ``-cc.backend x``), or the keys
    of the JSON object given after "=" or, with no "=", as the next argument ``following``. Raises
    :class:`EngineArgError` where that value is not a JSON object this module can read (vLLM reads
    a little more than JSON there, e.g. ``1k`` for 1000: such values are refused, not guessed at)."""
    key, sep, value = _rewritten(arg)[-1].partition("=")
    if "." in key:
        return {key.split(".")[1].removesuffix("+")}
    text = value if sep else following
    try:
        parsed = json.loads(text) if text is not None else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise EngineArgError(f"{key}: the value must be a JSON object (numbers written out) for the policy to read it")
    return set(parsed)


def _dotted_key(token: str) -> str:
    key = token.partition("=")[0]
    if not token.startswith("-") or "." not in key:
        return token
    return key.partition(".")[0]


def _read(token: str) -> list[str]:
    """The options argparse reads ``token`` as (its ``_parse_optional``)."""
    if not token.startswith("-") or token == "-":
        return []
    if token in OPTIONS:
        return [OPTIONS[token]]
    name, sep, attached = token.partition("=")
    if sep and name in OPTIONS:
        option = name
    else:
        found = _abbreviated(token)
        if len(found) > 1:
            raise EngineArgError(f"is ambiguous to vLLM ({', '.join(o for o, _ in found)}): write the option out")
        if not found:
            # A negative number, or a string with a space, is a value to argparse. (No vLLM option
            # starts with "-" and a digit; Python versions differ on which such strings are numbers.)
            if token[1].isdigit() or token[1] == "." or " " in token:
                return []
            raise EngineArgError(f"is not an option of vLLM {VLLM_VERSION}'s server")
        ((option, attached),) = found
    read = [OPTIONS[option]]
    # A single-dash switch with text after it: argparse reads the text as more one-letter options
    # (-xyz as -x -y -z), each taking the rest as its value unless it is a switch too.
    while option[1] != "-" and option in SWITCHES and attached:
        option, attached = "-" + attached[0], attached[1:].removeprefix("=")
        if option not in OPTIONS:
            raise EngineArgError(f"is not an option of vLLM {VLLM_VERSION}'s server")
        read.append(OPTIONS[option])
    return read


def _abbreviated(token: str) -> list[tuple[str, str]]:
    """The options ``token`` may stand for without naming one, each with the text it carries: those
    whose name starts with it (the part before "=") and, after one dash, a one-letter option with
    its value attached (-qfp8)."""
    prefix, _, attached = token.partition("=")
    found = []
    if not token.startswith("--") and token[:2] in OPTIONS:
        found.append((token[:2], token[2:]))
    # Python 3.11 matches a single-dash abbreviation on the whole string and 3.12 on the part before
    # "=": the latter finds more, so both are covered.
    return found + [(o, attached) for o in OPTIONS if o.startswith(prefix) and o != token[:2]]


_TEMPLATE = '''"""``vllm serve``'s options in vLLM {version}: every option string, the argparse ``dest`` it sets, and
which take no value. Generated from vLLM's server parser by ``python -m ucm.engine_args``
(``make generate``); a test fails when it drifts from the installed vLLM. Do not edit."""

VLLM_VERSION = "{version}"
OPTIONS: dict[str, str] = {{
{options}}}
SWITCHES: frozenset[str] = frozenset(
    {{
{switches}    }}
)
'''


def generate() -> str:
    """The text of ``ucm/vllm_options.py``, from the installed vLLM (``make dev`` has it)."""
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # As `python -m vllm.entrypoints.launchers.api_server.entry` (what `ucm serve` runs) builds it.
    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
    # What this module's reading assumes of the parser.
    if not parser.allow_abbrev or parser.prefix_chars != "-" or parser._has_negative_number_optionals:
        raise SystemExit("vLLM's parser changed how argparse reads options: revise ucm/engine_args.py")
    actions = sorted(parser._option_string_actions.items())  # argparse's table: option string -> action
    return _TEMPLATE.format(
        version=vllm.__version__,
        options="".join(f'    "{option}": "{action.dest}",\n' for option, action in actions),
        switches="".join(f'        "{option}",\n' for option, action in actions if action.nargs == 0),
    )


def main() -> int:
    text = generate()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
