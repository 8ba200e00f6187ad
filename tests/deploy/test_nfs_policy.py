"""An inline NFS store (``store.nfs``) is mounted into every engine pod, so a spec naming another
team's export would read and plant that team's KV blocks: the operator's policy allows exports by
server and path prefix (``--allow-nfs SERVER:/PREFIX``, the chart's ``policy.allowedNfs``), none by
default, checked by ``ucm render`` as by the operator (issue 34, Low)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.deploy.test_render_cmd import RESOURCE, render

ALLOWED = "nfs.example.com:/exports/a"


def with_nfs(server: str, path: str) -> dict[str, Any]:
    resource = copy.deepcopy(RESOURCE)
    resource["spec"]["store"] = {"type": "nfs", "nfs": {"server": server, "path": path}}
    return resource


def refused(tmp_path, capsys, resource: dict[str, Any], *flags: str) -> str:
    code, _, err = render(tmp_path, resource, *flags, capsys=capsys)
    assert code == 2, "rendered"
    return err


def test_inline_nfs_is_refused_by_default_naming_the_field(tmp_path, capsys):
    err = refused(tmp_path, capsys, with_nfs("nfs.example.com", "/exports/a"))
    assert (
        "spec.store.nfs.server: nfs.example.com:/exports/a is not allowed by the operator's policy "
        "(allowed: none; see policy.allowedNfs, --allow-nfs)"
    ) in err, err


def test_an_allowed_export_is_mounted(tmp_path, capsys):
    code, docs, err = render(
        tmp_path, with_nfs("nfs.example.com", "/exports/a/team"), "--allow-nfs", ALLOWED, capsys=capsys
    )
    assert code == 0, err
    decode = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "chat-decode")
    volumes = decode["spec"]["template"]["spec"]["volumes"]
    assert {"name": "kv", "nfs": {"server": "nfs.example.com", "path": "/exports/a/team"}} in volumes


@pytest.mark.parametrize(
    "path", ["/exports/a", "/exports/a/", "/exports/a/b", "/exports/a//b/./c", "/exports/a/b/../c"]
)
@pytest.mark.parametrize("prefix", ["/exports/a", "/exports/a/"])
def test_paths_under_the_prefix_pass(tmp_path, capsys, path, prefix):
    code, _, err = render(
        tmp_path, with_nfs("nfs.example.com", path), "--allow-nfs", f"nfs.example.com:{prefix}", capsys=capsys
    )
    assert code == 0, err


@pytest.mark.parametrize(
    "path",
    [
        "/exports/ab",  # a sibling whose name starts with the prefix
        "/exports/a/../b",  # climbs out
        "/exports/a/..",
        "/exports/a/b/../../../etc",
        "/exports",
        "/",
        "exports/a",  # relative
    ],
)
@pytest.mark.parametrize("prefix", ["/exports/a", "/exports/a/"])
def test_paths_outside_the_prefix_are_refused_naming_the_path(tmp_path, capsys, path, prefix):
    allowed = f"nfs.example.com:{prefix}"
    err = refused(tmp_path, capsys, with_nfs("nfs.example.com", path), "--allow-nfs", allowed)
    assert (
        f"spec.store.nfs.path: nfs.example.com:{path} is not allowed by the operator's policy (allowed: {allowed};"
        in err
    )


@pytest.mark.parametrize("server", ["other.example.com", "nfs.example.com.evil.io", "nfs", "10.0.0.2"])
def test_servers_are_matched_exactly(tmp_path, capsys, server):
    err = refused(tmp_path, capsys, with_nfs(server, "/exports/a"), "--allow-nfs", ALLOWED)
    assert f"spec.store.nfs.server: {server}:/exports/a is not allowed by the operator's policy" in err, err


def test_a_prefix_belongs_to_its_server(tmp_path, capsys):
    flags = ("--allow-nfs", ALLOWED, "--allow-nfs", "10.0.0.2:/kv")
    assert render(tmp_path, with_nfs("10.0.0.2", "/kv/b"), *flags, capsys=capsys)[0] == 0
    err = refused(tmp_path, capsys, with_nfs("10.0.0.2", "/exports/a"), *flags)
    assert "spec.store.nfs.path: 10.0.0.2:/exports/a is not allowed by the operator's policy " in err, err
    assert "(allowed: nfs.example.com:/exports/a, 10.0.0.2:/kv;" in err, err


def test_a_root_prefix_allows_every_export_of_the_server(tmp_path, capsys):
    code, _, err = render(tmp_path, with_nfs("fd00::2", "/any/where"), "--allow-nfs", "fd00::2:/", capsys=capsys)
    assert code == 0, err


@pytest.mark.parametrize(
    "value", ["nfs.example.com", "nfs.example.com:exports", ":/exports", "nfs.example.com:", "nfs/x:/exports"]
)
def test_allowed_exports_are_checked(tmp_path, capsys, value):
    with pytest.raises(SystemExit, match=f"--allow-nfs: '{value}' is not SERVER:/PATH"):
        render(tmp_path, RESOURCE, "--allow-nfs", value, capsys=capsys)
