"""The UCMDeployment CRD: generated from the models, checked in, structural, valid; the examples
validate against it; every CEL rule's Python twin rejects what the rule rejects."""

import copy
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from ucm.deploy.crd import CRD_FILE, generate, render
from ucm.deploy.schema import both_spellings
from ucm.deploy.spec import SPLIT_RULE, BlendSpec, SparseSpec, UCMDeploymentSpec, deprecated_fields
from ucm.sparse.config import OPTIONS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("ucmdeployment-*.yaml"))


@pytest.mark.parametrize("copy_", ["crds", "charts/ucm-operator/files"])
def test_checked_in_crds_are_what_the_models_generate(copy_):
    checked_in = (ROOT / copy_ / CRD_FILE).read_text()
    assert checked_in == render(), f"run: make generate ({copy_}/{CRD_FILE} drifted from the models)"


def walk(node, path="schema"):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    schema = generate()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "$defs", "title"} & set(node), path
        typed = (
            "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        )
        assert typed, f"{path} has no type"
        if "properties" in node:
            assert node["type"] == "object", path


@pytest.mark.parametrize("part", ["spec", "status"])
def test_every_field_is_described(part):
    """`kubectl explain ucmdeployment.<path>` prints the description: none may be empty (nested
    properties, array items and map values included). Describe a field with Field(description=...),
    a model shared by several fields with a docstring or a description on each field using it."""
    crd = yaml.safe_load((ROOT / "crds" / CRD_FILE).read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][part]
    bare = [path for path, node in walk(schema, part) if not (node.get("description") or "").strip()]
    assert not bare, f"{len(bare)} fields have no description:\n" + "\n".join(bare)


def test_crd_passes_kubernetes_validate_strict():
    exe = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(exe), "--strict", str(ROOT / "crds" / CRD_FILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def draft4(node):
    """The CRD schema as JSON Schema draft 4, with unknown fields rejected (the API server prunes them)."""
    node = copy.deepcopy(node)
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node:
        out["properties"] = {k: draft4(v) for k, v in node["properties"].items()}
        out["additionalProperties"] = False
    if isinstance(node.get("items"), dict):
        out["items"] = draft4(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = draft4(node["additionalProperties"])
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


SCHEMA = draft4(generate()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_and_the_models(path):
    doc = yaml.safe_load(path.read_text())
    jsonschema.Draft4Validator(SCHEMA).validate(doc)
    UCMDeploymentSpec.model_validate(doc["spec"])


def test_there_is_an_example_per_store_type():
    types = {yaml.safe_load(p.read_text())["spec"]["store"]["type"] for p in EXAMPLES}
    assert types == {"posix", "nfs", "ds3fs", "mooncake"}


def test_a_bad_blend_section_fails_the_schema():
    for bad in ({"recomputeRatio": 1.5}, {"recompute_ratio": 1.5}, {"separator": ""}, {"ratio": 0.1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft4Validator(SCHEMA).validate({"spec": with_("blend", bad)})
    jsonschema.Draft4Validator(SCHEMA).validate({"spec": with_("blend", {"recomputeRatio": 0.2, "checkLayer": 2})})


def test_a_bad_sparse_section_fails_the_schema():
    for bad in ({"algorithm": "quest"}, {"algorithm": "esa", "esa": {"sparseRatio": 1.5}}, {"esa": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft4Validator(SCHEMA).validate({"spec": with_("sparse", bad)})
    jsonschema.Draft4Validator(SCHEMA).validate(
        {"spec": with_("sparse", {"algorithm": "esa", "esa": {"sparseRatio": 0.2}})}
    )
    static = {"algorithm": "static", "static": {"retrievalStride": 1, "observationWindow": 0}}
    jsonschema.Draft4Validator(SCHEMA).validate({"spec": with_("sparse", static)})  # a one-value integer
    for field in ("retrievalStride", "observationWindow"):  # static neither retrieves nor scores
        with pytest.raises(jsonschema.ValidationError):
            bad = {**static, "static": {**static["static"], field: 2}}
            jsonschema.Draft4Validator(SCHEMA).validate({"spec": with_("sparse", bad)})


def test_old_spellings_still_validate_and_mean_the_same():
    """Resources written before sparse and blend took camelCase keep working (the CRD keeps the old
    names as deprecated twins, without defaults that would set both), each use reported."""
    old = with_("sparse", {"algorithm": "gsa_ondevice", "min_tokens": 64, "gsa_ondevice": {"hash_bits": 64}})
    old["blend"] = {"recompute_ratio": 0.2}
    new = with_("sparse", {"algorithm": "gsa_ondevice", "minTokens": 64, "gsaOndevice": {"hashBits": 64}})
    new["blend"] = {"recomputeRatio": 0.2}
    for doc in (old, new):
        jsonschema.Draft4Validator(SCHEMA).validate({"spec": doc})
    parsed = [UCMDeploymentSpec.model_validate(doc) for doc in (old, new)]
    assert parsed[0] == parsed[1]
    # what the engines read keeps their own (snake_case) names
    assert parsed[0].sparse.model_dump(exclude_unset=True) == {
        "algorithm": "gsa_ondevice",
        "min_tokens": 64,
        "gsa_ondevice": {"hash_bits": 64},
    }
    assert deprecated_fields(new) == []
    assert deprecated_fields(old) == [
        "spec.sparse.min_tokens is deprecated: write spec.sparse.minTokens",
        "spec.sparse.gsa_ondevice is deprecated: write spec.sparse.gsaOndevice",
        "spec.sparse.gsaOndevice.hash_bits is deprecated: write spec.sparse.gsaOndevice.hashBits",
        "spec.blend.recompute_ratio is deprecated: write spec.blend.recomputeRatio",
    ]


def test_renamed_fields_have_no_defaults_in_the_crd():
    renamed = [
        (f"{path}.{name}", child)
        for path, node in walk(generate()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        for name, child in (node.get("properties") or {}).items()
        if any(
            f"has(self.{name})" in r["rule"] and "deprecated" in r["message"]
            for r in node.get("x-kubernetes-validations", [])
        )
    ]
    assert len(renamed) >= 2 * len(TWIN_CASES)  # both spellings, some fields at several places
    assert [path for path, child in renamed if "default" in child] == []


def test_unknown_fields_and_bad_values_fail_the_schema():
    doc = yaml.safe_load(EXAMPLES[0].read_text())
    doc["spec"]["prefill"]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        jsonschema.Draft4Validator(SCHEMA).validate(doc)
    doc = yaml.safe_load(EXAMPLES[0].read_text())
    doc["spec"]["store"]["type"] = "s3"
    with pytest.raises(jsonschema.ValidationError, match="s3"):
        jsonschema.Draft4Validator(SCHEMA).validate(doc)


BASE = {"model": {"source": {"hf": "m"}}, "store": {"type": "nfs", "nfs": {"server": "s", "path": "/p"}}}


def with_(path: str, value):
    spec = copy.deepcopy(BASE)
    node = spec
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return spec


# Each CEL rule of the CRD, the spec that breaks it, and the message both must give.
CEL_CASES = [
    (
        with_("model.source", {"hf": "m", "hostPath": "/m"}),
        "model.source: exactly one of pvc, hostPath, hf must be set",
    ),
    (with_("model.source", {}), "model.source: exactly one of pvc, hostPath, hf must be set"),
    (
        with_(
            "decode",
            {"env": [{"name": "HF_TOKEN", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
        ),
        "env: give value or valueFrom, not both",
    ),
    (with_("store", {"type": "posix"}), "store.pvc: required when type is posix"),
    (with_("store", {"type": "nfs"}), "store.nfs: required when type is nfs"),
    (with_("store", {"type": "ds3fs"}), "store.ds3fs: required when type is ds3fs"),
    (with_("store", {"type": "mooncake"}), "store.mooncake: required when type is mooncake"),
    (
        with_("store", {"type": "posix", "pvc": {"claimName": "a", "create": {"size": "1Ti"}}}),
        "store.pvc: set exactly one of claimName, create",
    ),
    (
        with_("store", {"type": "mooncake", "mooncake": {"master": {}}, "mac": True}),
        "store.mac: only file stores (posix, nfs, ds3fs) sign blocks",
    ),
    (
        with_("store", {"type": "mooncake", "mooncake": {"master": {}}, "files": {"capacity": "1Gi"}}),
        "store.files: only for file stores (posix, nfs, ds3fs)",
    ),
    (
        with_(
            "store",
            {"type": "posix", "pvc": {"claimName": "a"}, "mac": True, "files": {"verifyChecksum": False}},
        ),
        "store.files.verifyChecksum: signed blocks (store.mac) are always verified",
    ),
    (
        with_("store", {"type": "mooncake", "mooncake": {"master": {}, "deviceName": "mlx5_0"}}),
        "store.mooncake.deviceName: only with protocol rdma",
    ),
    (
        with_("decode", {"envFrom": [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]}),
        "envFrom: set exactly one of secretRef, configMapRef",
    ),
    (
        with_("decode", {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
        "autoscaling: minReplicas must not exceed maxReplicas",
    ),
    (with_("monitoring", {"scrapers": [{}]}), "scrapers: set namespaceSelector, podSelector or both"),
    (
        with_("decode", {"rollout": {"maxSurge": 0, "maxUnavailable": 0}}),
        "rollout: maxSurge and maxUnavailable cannot both be 0",
    ),
    (
        with_("prefill", {"parallel": {"tensor": 4, "nodes": 3}}),
        "parallel.nodes: must divide tensor x pipeline (each pod runs an equal share of the ranks)",
    ),
    (
        with_("prefill", {"parallel": {"tensor": 8, "nodes": 2}, "resources": {"gpus": 8}}),
        "resources.gpus: one per rank a pod runs (tensor x pipeline / nodes), or 0 for CPU engines",
    ),
    (
        with_("decode", {"parallel": {"tensor": 3}, "resources": {"gpus": 3}})
        | {"prefill": {"parallel": {"tensor": 2}, "resources": {"gpus": 2}}},
        SPLIT_RULE,
    ),
    (
        with_("lora", {"adapters": [{"name": "a", "source": {"hostPath": "/a", "hf": "org/a", "revision": "0" * 40}}]}),
        "lora.adapters.source: exactly one of pvc, hostPath, hf must be set",
    ),
    (
        with_("lora", {"adapters": [{"name": "a", "source": {"hf": "org/a"}}]}),
        "lora.adapters.source.revision: required with hf (a commit hash: 40 hexadecimal digits)",
    ),
    (
        with_("lora", {"adapters": [{"name": "a", "source": {"hostPath": "/a", "revision": "0" * 40}}]}),
        "lora.adapters.source.revision: only with hf",
    ),
    (with_("lora", {"maxAdapters": 8, "maxCpuAdapters": 4}), "lora.maxCpuAdapters: must be at least maxAdapters"),
    *(
        (
            with_("sparse", {"algorithm": "psa" if name != "psa" else "esa", to_camel(name): {}}),
            f"sparse.{to_camel(name)}: options of another algorithm",
        )
        for name in OPTIONS
    ),
]


def _both_spellings(model: type, spec_of: Callable[[dict], dict]) -> list[tuple[dict, str]]:
    """For each renamed field of ``model``: the spec ``spec_of`` makes of it given under both names."""
    cases = []
    for field, info in model.model_fields.items():
        new = to_camel(field)
        if new != field:
            value = {} if info.default is None else info.default
            cases.append((spec_of({new: value, field: value}), both_spellings(new, field)))
    return cases


# A field renamed to camelCase keeps its old name as a deprecated twin; giving both is refused.
TWIN_CASES = [
    *_both_spellings(BlendSpec, lambda given: with_("blend", given)),
    *_both_spellings(SparseSpec, lambda given: with_("sparse", {"algorithm": "gsa_ondevice", **given})),
    *(
        case
        for name, options in OPTIONS.items()
        for case in _both_spellings(
            options, lambda given, name=name: with_("sparse", {"algorithm": name, to_camel(name): given})
        )
    ),
]


@pytest.mark.parametrize(("spec", "message"), TWIN_CASES)
def test_a_field_given_under_both_spellings_is_refused(spec, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        UCMDeploymentSpec.model_validate(spec)


@pytest.mark.parametrize(("spec", "message"), CEL_CASES)
def test_python_twins_of_the_cel_rules(spec, message):
    with pytest.raises(ValidationError) as exc:
        UCMDeploymentSpec.model_validate(spec)
    # the twin names the same fields as the CEL rule's message
    field = message.split(":")[0]
    assert field in str(exc.value)


def test_every_cel_rule_has_a_case():
    schema = generate()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = {rule["message"] for _, node in walk(schema) for rule in node.get("x-kubernetes-validations", [])}
    assert rules == {m for _, m in CEL_CASES + TWIN_CASES}


def test_defaults_fill_a_minimal_spec():
    spec = UCMDeploymentSpec.model_validate(BASE)
    assert spec.prefill.replicas == 1 and spec.decode.replicas == 1
    assert spec.model.block_size == 128 and spec.store.hashing.algorithm == "sha256"
    assert spec.proxy.config == {}  # the proxy applies its own defaults


def test_the_scale_subresource_scales_the_decode_pool():
    version = generate()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    root = version["schema"]["openAPIV3Schema"]

    def at(path: str) -> dict:
        node = root
        for part in path.lstrip(".").split("."):
            node = node["properties"][part]
        return node

    assert scale["specReplicasPath"] == ".spec.decode.replicas" and at(scale["specReplicasPath"])["type"] == "integer"
    assert at(scale["statusReplicasPath"])["type"] == "integer"
    assert at(scale["labelSelectorPath"])["type"] == "string"
