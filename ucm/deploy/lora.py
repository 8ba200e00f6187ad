"""LoRA adapters a deployment serves (``spec.lora``): where each comes from, and how every engine of
both pools gets it.

Both pools get the same vLLM flags in the same order: a prefill engine pairs only with a decode
engine whose flags agree (``ucm.integration.vllm.identity.pairing_identity``), and a decode must serve
every adapter its prefill does. vLLM is always given a directory inside the engine's container,
never a hub id: the connector names an adapter's blocks by a fingerprint of its files
(``adapter_config.json`` and weights), which it can read only from a directory. So a hub adapter is
downloaded at its pinned revision before the engine starts — in Kubernetes by an init container of
every engine pod into an emptyDir, locally (``ucm up``) once into the run directory — by this
module's ``python3 -m ucm.deploy.lora REPO REVISION DIR``.

Run as that command, this module imports huggingface_hub (installed with vLLM in the runtime image);
imported, it needs only pydantic.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ucm import engine_args
from ucm.deploy.roles import Site, Step, Volume, fail
from ucm.deploy.schema import Arg, Spec, cel, one_of

# vLLM 0.32's accepted --max-lora-rank values (vllm.config.lora.MaxLoRARanks).
MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# What a client may put in "model": the proxy and vLLM compare it as given, and KV events carry it.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
NAME_RULE = "letters, digits and . _ : / -, starting with a letter or digit, at most 128 characters"
# A commit: a branch or tag can move, and engines started at different times would serve other weights.
REVISION_PATTERN = r"^[0-9a-f]{40}$"
MAX_ADAPTERS_LISTED = 64
HUB_VOLUME = "lora-hub"  # the emptyDir hub adapters are downloaded into

# vLLM options spec.lora renders: in a spec's extra arguments they would serve adapters one pool
# lacks, or from places the operator's policy does not see. (--default-mm-loras names adapters by
# path too.) LoRA tuning options (--lora-dtype, --lora-target-modules, --fully-sharded-loras, ...)
# stay open there: they change no source, and the pairing identity covers them.
RENDERED = {
    "enable_lora": "--enable-lora",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
    "max_cpu_loras": "--max-cpu-loras",
    "lora_modules": "--lora-modules",
    "default_mm_loras": "--default-mm-loras",
}


class AdapterPVC(Spec):
    claim_name: str = Field(min_length=1, description="PersistentVolumeClaim holding the adapter")
    path: str = Field("/", description="The adapter's directory inside the claim (its adapter_config.json)")


class AdapterSource(Spec):
    """Where an adapter comes from: exactly one of pvc, hostPath, hf (with revision)."""

    model_config = Spec.model_config | cel(
        (
            "[has(self.pvc), has(self.hostPath), has(self.hf)].filter(x, x).size() == 1",
            "lora.adapters.source: exactly one of pvc, hostPath, hf must be set",
        ),
        (
            "!has(self.hf) || has(self.revision)",
            "lora.adapters.source.revision: required with hf (a commit hash: 40 hexadecimal digits)",
        ),
        ("!has(self.revision) || has(self.hf)", "lora.adapters.source.revision: only with hf"),
    )
    pvc: AdapterPVC | None = Field(
        None,
        description="A PersistentVolumeClaim holding the adapter, mounted read-only in every engine pod of both "
        "pools (Kubernetes only: `ucm up` refuses it)",
    )
    host_path: str | None = Field(
        None,
        min_length=1,
        description="The adapter's directory on every node, mounted read-only; only under the node directories "
        "the operator's policy allows (policy.hostPathPrefixes). Locally: a directory on this machine",
        json_schema_extra={"pattern": "^/"},
    )
    hf: str | None = Field(
        None,
        min_length=1,
        description="A Hugging Face repository id, downloaded at revision before each engine starts (an init "
        "container in every engine pod, into an emptyDir; locally into the run directory). The pool's env "
        "reaches the download: HF_TOKEN for a private repository, HF_ENDPOINT for a mirror",
    )
    revision: str | None = Field(
        None,
        description="With hf, required: the commit to download (40 hexadecimal digits). A branch or a tag can "
        "move, and engines started at different times would serve different weights",
        json_schema_extra={"pattern": REVISION_PATTERN},
    )

    @field_validator("host_path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"an absolute path is needed, got {value!r}")
        return value

    @field_validator("revision")
    @classmethod
    def _commit(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(REVISION_PATTERN, value):
            raise ValueError(
                f"{value!r} is not a commit hash (40 hexadecimal digits, lower case): a branch or tag can move"
            )
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> AdapterSource:
        one_of(self, ("pvc", "host_path", "hf"), "lora.adapters.source")
        if self.hf is not None and self.revision is None:
            raise ValueError(
                f"lora.adapters.source.revision: required with hf (a commit hash: 40 hexadecimal digits); {self.hf} "
                "unpinned would be whatever its main branch is when each engine starts"
            )
        if self.revision is not None and self.hf is None:
            raise ValueError("lora.adapters.source.revision: only with hf")
        return self


class Adapter(Spec):
    """One adapter: the name requests ask for it by, and where its files come from."""

    name: str = Field(
        description=f"What clients put in a request's model field: {NAME_RULE}; unique, and not the base "
        "model's served name",
        json_schema_extra={"pattern": NAME_PATTERN, "maxLength": 128, "minLength": 1},
    )
    source: AdapterSource = Field(description="Where the adapter comes from: exactly one of pvc, hostPath, hf")

    @field_validator("name")
    @classmethod
    def _served_name(cls, value: str) -> str:
        if len(value) > 128 or not re.fullmatch(NAME_PATTERN, value):
            raise ValueError(f"{value!r} is not a served model name ({NAME_RULE})")
        return value


class LoraSpec(Spec):
    """LoRA adapters every engine of both pools serves beside the base model (vLLM --enable-lora):
    a request names one in its model field. Block ids name an adapter by its files' content, so
    its KV is never mistaken for the base model's or another adapter's."""

    model_config = Spec.model_config | cel(
        (
            "!has(self.maxCpuAdapters) || self.maxCpuAdapters >= self.maxAdapters",
            "lora.maxCpuAdapters: must be at least maxAdapters",
        ),
    )
    adapters: list[Adapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS_LISTED,
        description="The adapters, by name (at most 64). Empty: engines ready for adapters loaded at runtime, "
        "which the operator's policy refuses unless it allows it for this deployment",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    max_adapters: int = Field(
        4,
        ge=1,
        le=256,
        description="Adapters one batch may mix (vLLM --max-loras): each a slot of GPU memory sized by maxRank; "
        "requests for more wait",
    )
    max_rank: Literal[MAX_RANKS] = Field(  # type: ignore[valid-type]
        16,
        description="The largest adapter rank served (vLLM --max-lora-rank): "
        + ", ".join(map(str, MAX_RANKS))
        + "; an adapter of a larger rank fails to load",
    )
    max_cpu_adapters: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Adapters kept in host memory (vLLM --max-cpu-loras), at least maxAdapters; others are "
        "read from their directory again when asked for. Default: maxAdapters",
    )

    @model_validator(mode="after")
    def _bounds(self) -> LoraSpec:
        seen: dict[str, int] = {}
        for i, adapter in enumerate(self.adapters):
            if adapter.name in seen:
                raise ValueError(
                    f"lora.adapters[{i}].name: {adapter.name} is also lora.adapters[{seen[adapter.name]}]'s; "
                    "names are unique"
                )
            seen[adapter.name] = i
        if self.max_cpu_adapters is not None and self.max_cpu_adapters < self.max_adapters:
            raise ValueError(
                f"lora.maxCpuAdapters: must be at least maxAdapters ({self.max_cpu_adapters} < {self.max_adapters})"
            )
        return self


@dataclass(frozen=True)
class Rendered:
    """What every engine of both pools gets for ``spec.lora``."""

    args: list[str]  # vLLM flags
    volumes: list[Volume]  # beyond the model's
    steps: list[Step]  # downloads that finish before the engine starts


def render(lora: LoraSpec, site: Site, mounted_claims: Mapping[str, str]) -> Rendered:
    """``lora`` as flags, volumes and downloads. ``mounted_claims``: claims the engines mount already
    (the model's), by mount path: an adapter on one of them is read there, not mounted twice.
    Raises :class:`PlanError` for a source this site cannot have."""
    claims = dict(mounted_claims)
    volumes: list[Volume] = []
    steps: dict[str, Step] = {}  # by directory: one download per repository and revision
    modules = []
    for i, adapter in enumerate(lora.adapters):
        source, where = adapter.source, f"lora.adapters[{i}].source"
        if source.pvc is not None:
            if site.local:
                raise fail(
                    f"{where}.pvc", "a PersistentVolumeClaim exists only in Kubernetes; locally use hostPath or hf"
                )
            claim = source.pvc.claim_name
            if claim not in claims:
                claims[claim] = f"{site.adapters_dir}/pvc/{claim}"
                # Named for the first adapter on it; each claim mounted once.
                on_claim = {"persistentVolumeClaim": {"claimName": claim}}
                volumes.append(Volume(f"lora-pvc-{i}", claims[claim], on_claim, True))
            path = f"{claims[claim]}/{source.pvc.path.strip('/')}".rstrip("/")
        elif source.host_path is not None:
            path = source.host_path
            if not site.local:
                # At a fixed point, as the model's: a node path mounted where it is could cover the
                # image's own directories.
                path = f"{site.adapters_dir}/node/{i}"
                node = {"hostPath": {"path": source.host_path, "type": "Directory"}}
                volumes.append(Volume(f"lora-node-{i}", path, node, True))
        else:
            assert source.hf is not None and source.revision is not None
            # Named by repository and commit: a directory never holds another adapter's files.
            path = f"{site.adapters_dir}/hub/{source.hf.replace('/', '--')}--{source.revision}"
            if path not in steps:
                command = ["python3", "-m", "ucm.deploy.lora", source.hf, source.revision, path]
                steps[path] = Step(f"adapter-{len(steps)}", command, writes=(HUB_VOLUME,))
        modules.append(json.dumps({"name": adapter.name, "path": path}, separators=(",", ":")))
    if steps and not site.local:
        volumes.append(Volume(HUB_VOLUME, f"{site.adapters_dir}/hub", {"emptyDir": {}}, True))
    args = ["--enable-lora", "--max-loras", str(lora.max_adapters), "--max-lora-rank", str(lora.max_rank)]
    if lora.max_cpu_adapters is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_adapters)]
    if modules:
        args += ["--lora-modules", *modules]
    return Rendered(args, volumes, list(steps.values()))


def refuse_in_extra_args(field: str, args: list[Arg]) -> None:
    """Raises :class:`PlanError` for an extra argument that sets what ``spec.lora`` renders, however
    spelled."""
    for dest, flag in RENDERED.items():
        for i, arg in engine_args.setting(args, dest):
            written = arg.partition("=")[0]
            how = "" if written == flag else f" (vLLM reads {written} as {flag})"
            raise fail(f"{field}[{i}]", f"{flag}: set spec.lora{how}; adapters come from there, alike in both pools")


def fetch(repo: str, revision: str, directory: str) -> Path:
    """Download ``repo`` at ``revision`` into ``directory``; an error unless it holds a LoRA adapter."""
    from huggingface_hub import snapshot_download

    path = Path(snapshot_download(repo, revision=revision, local_dir=directory))
    if not (path / "adapter_config.json").is_file():
        raise SystemExit(f"{repo}@{revision}: no adapter_config.json; not a LoRA adapter repository")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m ucm.deploy.lora", description="download a LoRA adapter at a pinned revision"
    )
    p.add_argument("repo", help="a Hugging Face repository id")
    p.add_argument("revision", help="a commit hash")
    p.add_argument("directory", help="where to put the adapter's files")
    args = p.parse_args(argv)
    print(fetch(args.repo, args.revision, args.directory), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
