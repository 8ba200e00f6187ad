"""The operator reads a spec's vLLM arguments as vLLM's own parser does (issue 34, H2): checked here,
where vLLM is installed, against the parser ``python -m vllm.entrypoints.launchers.api_server.entry`` (what
``ucm serve`` runs) builds, on spellings generated the ways that parser accepts: underscores for
dashes, abbreviations, ``=`` or a separate value, dotted sub-keys, ``--no-`` forms, short options."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.deploy.test_render_cmd import RESOURCE
from ucm import engine_args, vllm_options
from ucm.deploy.policy import REFUSED_FLAGS, REFUSED_KEYS, Policy
from ucm.deploy.roles import PlanError
from ucm.deploy.spec import UCMDeploymentSpec


class Oracle:
    """vLLM's server parser, recording the option (argparse ``dest``) each argument sets."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.values: dict[str, str | None] = {}  # an option's dest -> a value it takes (None: none)

    def __repr__(self) -> str:
        return "Oracle(vLLM's server parser)"

    def dests(self, argv: list[str]) -> set[str] | None:
        """The options ``argv`` sets, or None where vLLM's parser refuses it."""
        self.parser.seen = set()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                self.parser.parse_args(argv)
        except (SystemExit, Exception):
            return None
        return self.parser.seen

    def option_strings(self) -> dict[str, str]:
        return {o: a.dest for o, a in self.parser._option_string_actions.items() if a.dest in self.values}


@pytest.fixture(scope="module")
def vllm_parser(tmp_path_factory) -> Oracle:
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Recording(FlexibleArgumentParser):
        seen: set[str]

        def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
            if action.option_strings:  # argparse calls this once per option it takes
                self.seen.add(action.dest)
            return super()._get_values(action, arg_strings)

    # As vllm.entrypoints.launchers.api_server.entry.main builds it.
    oracle = Oracle(make_arg_parser(Recording(description="vLLM OpenAI-Compatible RESTful API server.")))
    options_file = tmp_path_factory.mktemp("vllm") / "options.yaml"
    options_file.write_text("trust-remote-code: true\n")
    # --config FILE sets the options the file names (and not config itself).
    oracle.values["config"] = str(options_file)
    for action in oracle.parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        if action.nargs == 0:
            oracle.values[action.dest] = None
            continue
        choices = [str(c) for c in action.choices or ()][:1]
        for value in [*choices, "1", "{}", "auto", "x"]:
            if oracle.dests([action.option_strings[0], value]) == {action.dest}:
                oracle.values[action.dest] = value
                break
    return oracle


def shortest_unique(option: str, options: list[str]) -> int:
    """The length of the shortest abbreviation argparse completes to ``option`` alone (the whole
    option where it starts another: --config, --config-format)."""
    unique = (n for n in range(3, len(option)) if sum(o.startswith(option[:n]) for o in options) == 1)
    return next(unique, len(option))


def spell_name(data: st.DataObject, option: str, options: list[str]) -> str:
    """``option`` abbreviated and with underscores for dashes, as vLLM's parser may read it."""
    if not option.startswith("--"):
        return option
    name = option[: data.draw(st.integers(shortest_unique(option, options), len(option)), label="length")]
    underscores = data.draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)), label="underscores")
    return "--" + "".join("_" if c == "-" and u else c for c, u in zip(name[2:], underscores[2:], strict=True))


def spell(data: st.DataObject, option: str, value: str | None, options: list[str]) -> list[str]:
    """One way to write ``option`` (and its value) that vLLM's parser may read as it."""
    name = spell_name(data, option, options)
    form = data.draw(st.sampled_from(["plain", "dotted", "dotted-separate"]), label="form")
    if form != "plain":
        key = data.draw(st.sampled_from(["x", "kv_connector", "mode", "pass_config.x"]), label="key")
        name = f"{name}.{key}"
        value = "1" if value is None else value
    if value is None:
        return [name]
    if form == "dotted-separate":
        return [name, value]
    forms = ["separate", "equals"] + (["attached"] if len(option) == 2 else [])
    written = data.draw(st.sampled_from(forms), label="value form")
    return {"separate": [name, value], "equals": [f"{name}={value}"], "attached": [name + value]}[written]


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(data=st.data())
def test_every_spelling_of_a_refused_option_that_vllm_reads_is_refused(vllm_parser, data):
    options = vllm_parser.option_strings()
    refused = {options[flag] for flag in REFUSED_FLAGS}
    option = data.draw(st.sampled_from(sorted(o for o, dest in options.items() if dest in refused)), label="option")
    before = ["--max-num-seqs", "8"]
    args = before + spell(data, option, vllm_parser.values[options[option]], list(options))
    read = vllm_parser.dests(args)
    event("vLLM reads a refused option" if read and read & refused else "vLLM refuses the arguments")
    if read is None or not read & refused:
        return  # vLLM refuses this spelling itself (an ambiguous abbreviation, a value its type refuses)
    spec = UCMDeploymentSpec.model_validate({**RESOURCE["spec"], "decode": {"extraArgs": args}})
    with pytest.raises(PlanError, match=rf"^decode\.extraArgs\[{len(before)}\]: --[a-z-]+ is not allowed: "):
        Policy().check(spec, "default", "demo")


# Keys of the JSON options the policy reads, refused (REFUSED_KEYS) and not, with JSON values vLLM takes.
KEY_VALUES = {
    "compilation_config": {
        **{"backend": '"eager"', "inductor_passes": "{}", "inductor_compile_config": "{}", "cache_dir": '"/tmp/c"'},
        **{"mode": "3", "cudagraph_capture_sizes": "[1, 2]", "custom_ops": '["none"]'},
    },
    "hf_overrides": {"auto_map": "{}", "max_position_embeddings": "9000", "rope_theta": "20000.0"},
}


@SETTINGS
@given(data=st.data())
def test_every_way_to_set_a_refused_key_that_vllm_reads_is_refused(vllm_parser, data):
    options = vllm_parser.option_strings()
    option = data.draw(st.sampled_from(sorted(o for o, dest in options.items() if dest in KEY_VALUES)), label="option")
    dest = options[option]
    key, value = data.draw(st.sampled_from(sorted(KEY_VALUES[dest].items())), label="key")
    name = spell_name(data, option, list(options))
    form = data.draw(st.sampled_from(["separate", "equals", "dotted", "dotted-separate"]), label="form")
    written = {
        "separate": [name, f'{{"{key}": {value}}}'],
        "equals": [f'{name}={{"{key}": {value}}}'],
        "dotted": [f"{name}.{key}={value}"],
        "dotted-separate": [f"{name}.{key}", value],
    }[form]
    before = ["--max-num-seqs", "8"]
    args = before + written
    if vllm_parser.dests(args) is None:
        event("vLLM refuses the arguments")
        return  # the engine would not start
    event(f"vLLM reads them: {'refused' if key in REFUSED_KEYS[dest] else 'allowed'} key")
    spec = UCMDeploymentSpec.model_validate({**RESOURCE["spec"], "decode": {"extraArgs": args}})
    if key in REFUSED_KEYS[dest]:
        with pytest.raises(PlanError, match=rf"^decode\.extraArgs\[{len(before)}\]: .* the key {key} is not allowed: "):
            Policy().check(spec, "default", "demo")
    else:
        Policy().check(spec, "default", "demo")


def test_a_file_of_options_is_one_more_way_to_pass_a_refused_one(vllm_parser):
    assert vllm_parser.dests(["--config", vllm_parser.values["config"] or ""]) == {"trust_remote_code"}


def read(args: list[str]) -> set[str]:
    return {dest for arg in args for dest in engine_args.dests(arg)}


@SETTINGS
@given(data=st.data())
def test_the_operator_reads_arguments_as_vllm_does(vllm_parser, data):
    # All but --config FILE, which sets the options in the file: the operator reads (and refuses) config.
    options = {o: dest for o, dest in vllm_parser.option_strings().items() if dest != "config"}
    args: list[str] = []
    for _ in range(data.draw(st.integers(1, 3), label="options")):
        option = data.draw(st.sampled_from(sorted(options)), label="option")
        args += spell(data, option, vllm_parser.values[options[option]], list(options))
    vllm_read = vllm_parser.dests(args)
    event("vLLM refuses the arguments" if vllm_read is None else "vLLM reads them")
    if vllm_read is not None:  # else the engine would not start: nothing to agree on
        assert read(args) == vllm_read


# Pieces of option names, values and the characters vLLM's rewriting and argparse treat specially.
FRAGMENTS = [
    *("--trust", "-remote", "-code", "--kv", "-transfer", "-config", "--api", "-key", "--port", "--no", "--log"),
    *("--max-num-seqs", "--enable-prefix-caching", "-file", "-O", "-tp", "-ep", "-dph", "-sc", "-q", "-h", "-n"),
    *("-r", "-", "--", "q", "h", "e", "p", "=", ".", "_", "+", " ", "1", "fp8", "{}"),
]


@SETTINGS
@given(args=st.lists(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=5).map("".join), max_size=3))
def test_the_operator_never_reads_less_than_vllm(vllm_parser, args):
    """On any strings: the operator refuses them, or reads every option vLLM reads (more where a
    dotted option without "=" takes the next argument as its value: that one is read on its own)."""
    vllm_read = vllm_parser.dests(args)
    event("vLLM refuses the arguments" if vllm_read is None else "vLLM reads them")
    with contextlib.suppress(engine_args.EngineArgError):
        assert read(args) >= (vllm_read or set())


EXAMPLES = [
    (["--trust_remote_code"], {"trust_remote_code"}),
    (["--trust-remote"], {"trust_remote_code"}),
    (["--no-trust-remote-code"], {"trust_remote_code"}),
    (["--trust-remote-code.x=1"], {"trust_remote_code"}),  # {"x": 1} is left over as the positional model
    (["--kv-transfer-config.kv_connector=X", "--kv-transfer-config.kv_role", "kv_both"], {"kv_transfer_config"}),
    (["--kv_transfer.kv_connector", "X", "--kv-transfer.kv_role=kv_both"], {"kv_transfer_config"}),
    (["--max_num_seqs=8", "--max-model", "4096"], {"max_num_seqs", "max_model_len"}),
    (["-O3"], {"optimization_level"}),
    (["-O=3"], {"optimization_level"}),
    (["-O", "3"], {"optimization_level"}),
    (["-tp=2", "-pp", "1"], {"tensor_parallel_size", "pipeline_parallel_size"}),
    (["-qfp8"], {"quantization"}),
    (["-ep=qfp8"], {"enable_expert_parallel", "quantization"}),  # -ep, then -q with the rest attached
    (["--max-model-len 10"], set()),  # one string with a space: a value to argparse
]


@pytest.mark.parametrize(("args", "options"), EXAMPLES, ids=[" ".join(a) for a, _ in EXAMPLES])
def test_examples_read_as_vllm_reads_them(vllm_parser, args, options):
    assert vllm_parser.dests(args) == options
    assert read(args) == options


def test_the_option_table_is_what_vllm_generates(vllm_parser):
    checked_in = Path(vllm_options.__file__).read_text()
    assert checked_in == engine_args.generate(), "run: make generate (ucm/vllm_options.py drifted from vLLM)"
