"""``ucm render``: the operator's objects for a resource file, with the operator's validation."""

from __future__ import annotations

import io

import pytest
import yaml

from ucm.cli import main
from ucm.deploy.kubernetes import DESIRED_HASH
from ucm.deploy.spec import UCMDeploymentSpec

RESOURCE = {
    "apiVersion": "ucm.io/v1alpha1",
    "kind": "UCMDeployment",
    "metadata": {"name": "chat", "namespace": "team-a"},
    "spec": {
        "model": {"source": {"hf": "Qwen/Qwen3-0.6B"}},
        "store": {"type": "posix", "pvc": {"claimName": "kv"}},
    },
}


def render(tmp_path, resource: dict, *args: str, capsys) -> tuple[int, list[dict], str]:
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(resource))
    code = main(["render", "-f", str(path), *args])
    out, err = capsys.readouterr()
    return code, [d for d in yaml.safe_load_all(out) if d] if code == 0 else [], err


def test_names_and_namespace_come_from_the_resource_or_flags(tmp_path, capsys):
    code, docs, _ = render(tmp_path, RESOURCE, capsys=capsys)
    assert code == 0
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}
    assert ("Deployment", "chat-decode") in {(d["kind"], d["metadata"]["name"]) for d in docs}
    _, docs, _ = render(tmp_path, RESOURCE, "-n", "team-b", "--name", "other", capsys=capsys)
    assert {d["metadata"]["namespace"] for d in docs} == {"team-b"}
    assert all(d["metadata"]["name"].startswith("other-") for d in docs)


def test_the_owner_uid_gives_owner_references_and_changes_the_hash(tmp_path, capsys):
    _, plain, _ = render(tmp_path, RESOURCE, capsys=capsys)
    _, owned, _ = render(tmp_path, RESOURCE, "--owner-uid", "1234", capsys=capsys)
    assert all(d["metadata"]["ownerReferences"][0]["uid"] == "1234" for d in owned)
    assert plain[0]["metadata"]["annotations"][DESIRED_HASH] != owned[0]["metadata"]["annotations"][DESIRED_HASH]
    with_uid = {**RESOURCE, "metadata": {**RESOURCE["metadata"], "uid": "1234"}}
    assert render(tmp_path, with_uid, capsys=capsys)[1] == owned  # read back from the API server


def test_standard_input(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(RESOURCE)))
    assert main(["render", "-f", "-"]) == 0
    assert "kind: Deployment" in capsys.readouterr().out


def test_the_operators_bounds_apply_and_widen_with_the_same_flags(tmp_path, capsys):
    spec = {**RESOURCE["spec"], "model": {"source": {"hostPath": "/models/qwen"}}}
    code, _, err = render(tmp_path, {**RESOURCE, "spec": spec}, capsys=capsys)
    assert code == 2 and "spec.model.source.hostPath: /models/qwen is not under an allowed host path" in err
    code, docs, _ = render(tmp_path, {**RESOURCE, "spec": spec}, "--allow-host-path", "/models", capsys=capsys)
    assert code == 0 and any(d["kind"] == "Deployment" for d in docs)
    mine = {**RESOURCE["spec"], "image": {"repository": "registry.example/ucm-runtime"}}
    code, _, err = render(tmp_path, {**RESOURCE, "spec": mine}, capsys=capsys)
    assert code == 2 and "spec.image.repository: registry.example/ucm-runtime is not from an allowed" in err
    widened = render(tmp_path, {**RESOURCE, "spec": mine}, "--allow-image-prefix", "registry.example/", capsys=capsys)
    assert widened[0] == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"metadata": {}}, "--name: required"),
        ({"spec": {"model": {"source": {}}, "store": RESOURCE["spec"]["store"]}}, "spec.model.source"),
        ({"kind": "Deployment"}, "not a UCMDeployment"),
        (
            {"spec": {**RESOURCE["spec"], "store": {"type": "mooncake", "mooncake": {}}}},
            "spec.store.mooncake: set exactly one of master",
        ),
        (
            {"spec": {**RESOURCE["spec"], "proxy": {"config": {"routing": {"prefill": "bogus"}}}}},
            "spec.proxy.config: ucm-proxy refuses it: proxy.routing.prefill: Input should be",
        ),
        # UCM's own variables an engine would refuse at startup, over and over.
        (
            {"spec": {**RESOURCE["spec"], "decode": {"env": [{"name": "UCM_STORAGE_BACKEND", "value": "nfs"}]}}},
            "spec.decode: env: UCM_STORAGE_BACKEND: not supported",
        ),
        (
            {"spec": {**RESOURCE["spec"], "prefill": {"env": [{"name": "UCM_LOG_LEVEL", "value": "LOUD"}]}}},
            "spec.prefill: env: UCM_LOG_LEVEL: 'LOUD' is not one of",
        ),
    ],
)
def test_what_the_operator_refuses_is_refused_naming_the_field(tmp_path, capsys, change, message):
    code, _, err = render(tmp_path, {**RESOURCE, **change}, capsys=capsys)
    assert code == 2
    assert message in err, err


def test_ucm_variables_an_engine_honours_pass_and_a_secret_cannot_hide_a_refused_one():
    secret = {"secretKeyRef": {"name": "s", "key": "k"}}
    env = [{"name": "UCM_LOG_LEVEL", "value": "debug"}, {"name": "UCM_STORE_HEALTH_FILE", "value": "/tmp/h"}]
    env.append({"name": "UCM_LOG_FORMAT", "valueFrom": secret})  # its value is unseen: checked at startup
    env += [{"name": "LEVEL", "value": "DEBUG"}, {"name": "UCM_DEBUG", "value": "$(LEVEL)"}]  # the pod expands it
    UCMDeploymentSpec.model_validate({**RESOURCE["spec"], "decode": {"env": env}})
    hidden = [{"name": "UCM_STORAGE_BACKEND", "valueFrom": secret}]
    with pytest.raises(ValueError, match="UCM_STORAGE_BACKEND: not supported"):
        UCMDeploymentSpec.model_validate({**RESOURCE["spec"], "decode": {"env": hidden}})


def test_an_old_spelling_renders_with_a_warning(tmp_path, capsys):
    cpu = {**RESOURCE["spec"], "prefill": {"resources": {"gpus": 0}}}
    new = {**cpu, "blend": {"recomputeRatio": 0.2}}
    old = {**cpu, "blend": {"recompute_ratio": 0.2}}
    code, with_new, err = render(tmp_path, {**RESOURCE, "spec": new}, capsys=capsys)
    assert code == 0 and "warning" not in err
    code, with_old, err = render(tmp_path, {**RESOURCE, "spec": old}, capsys=capsys)
    assert code == 0 and with_old == with_new
    assert "warning: " in err and "spec.blend.recompute_ratio is deprecated: write spec.blend.recomputeRatio" in err


def test_a_field_by_its_python_name_is_refused_as_the_api_server_would(tmp_path, capsys):
    """The CRD knows proxy.apiKeySecret only; `kubectl apply` refuses api_key_secret, so render does too."""
    spec = {**RESOURCE["spec"], "proxy": {"api_key_secret": {"name": "keys"}}}
    code, _, err = render(tmp_path, {**RESOURCE, "spec": spec}, capsys=capsys)
    assert code == 2 and "spec.proxy.api_key_secret: unknown field" in err
