"""Bottle spec validation: every field, with errors that name it."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from bottlenet.bottles.spec import check_egress_host, parse_bottle_spec
from bottlenet.errors import InvalidArgument

SPEC = """
mode = "auto"
[sidecar]
image = "/var/lib/bottles/sidecar.tar"
cpus = 1
mem = 512
[[sidecar.service]]
name = "egress"
guest_port = 3128
env = ["HTTPS_PROXY=http://{host}:{port}", "HTTP_PROXY=http://{host}:{port}"]
[sidecar.egress]
allow_hosts = ["api.anthropic.com", "*.github.com"]
policy_path = "/etc/bottle/egress-allow.txt"
reload = ["/usr/local/bin/egress-reload"]
[agent]
image = "/var/lib/bottles/agent.tar"
cpus = 2
mem = 2048
env = ["TERM=xterm-256color"]
"""


def doc(**changes: Any) -> dict[str, Any]:
    data = tomllib.loads(SPEC)
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        table = data
        for part in path:
            table = table[part]
        if value is KeyError:
            del table[last]
        else:
            table[last] = value
    return data


def test_issue_example_parses() -> None:
    spec = parse_bottle_spec("b1", doc())
    assert spec.mode == "auto" and spec.has_vms
    assert spec.sidecar is not None and spec.agent is not None
    assert spec.sidecar.services[0].guest_port == 3128
    assert spec.sidecar.egress is not None
    assert spec.sidecar.egress.allow_hosts == ("api.anthropic.com", "*.github.com")
    assert spec.agent.volumes == ()
    assert spec.sidecar.egress.connect_proxy is None
    proxied = parse_bottle_spec("b1", doc(sidecar__egress__connect_proxy="egress"))
    assert proxied.sidecar is not None and proxied.sidecar.egress is not None
    assert proxied.sidecar.egress.connect_proxy == "egress"


def test_forward_only_mode() -> None:
    spec = parse_bottle_spec("b1", {"mode": "none"})
    assert not spec.has_vms and spec.sidecar is None
    with pytest.raises(InvalidArgument, match="forward-only"):
        parse_bottle_spec("b1", {"mode": "none", "agent": {"image": "/x"}})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"mode": "bridge"}, "mode"),
        ({"sidecar": KeyError}, "sidecar: missing"),
        ({"agent__image": KeyError}, "agent.image: missing"),
        ({"agent__image": ""}, "agent.image"),
        ({"agent__cpus": 0}, "agent.cpus"),
        ({"agent__cpus": True}, "agent.cpus"),
        ({"agent__mem": 32}, "agent.mem"),
        ({"agent__env": ["1BAD=x"]}, "agent.env[0]"),
        ({"agent__env": ["NOEQUALS"]}, "agent.env[0]"),
        ({"agent__env": ["A=b\nc"]}, "agent.env[0]"),
        ({"agent__volumes": ["relative:/work"]}, "agent.volumes[0]"),
        ({"agent__colour": "red"}, "agent.colour: unknown key"),
        ({"sidecar__service": []}, "sidecar.service"),
        ({"sidecar__service": [{"name": "Egress", "guest_port": 1}]}, "sidecar.service[0].name"),
        ({"sidecar__service": [{"name": "e", "guest_port": 0}]}, "sidecar.service[0].guest_port"),
        (
            {"sidecar__service": [{"name": "e", "guest_port": 1, "env": ["X={secret}"]}]},
            "sidecar.service[0].env[0]: placeholders are",
        ),
        (
            {"sidecar__service": [{"name": "e", "guest_port": 1}, {"name": "e", "guest_port": 2}]},
            "unique",
        ),
        ({"sidecar__egress__allow_hosts": ["Example.com"]}, "sidecar.egress.allow_hosts"),
        ({"sidecar__egress__allow_hosts": ["x"] * 300}, "sidecar.egress.allow_hosts"),
        ({"sidecar__egress__policy_path": "etc/x"}, "sidecar.egress.policy_path"),
        ({"sidecar__egress__reload": []}, "sidecar.egress.reload"),
        ({"sidecar__egress__reload": ["reload"]}, "sidecar.egress.reload"),
        ({"sidecar__egress__connect_proxy": "git"}, "sidecar.egress.connect_proxy"),
        ({"sidecar__egress__connect_proxy": 3128}, "sidecar.egress.connect_proxy"),
    ],
)
def test_bad_fields_are_named(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_bottle_spec("b1", doc(**changes))
    assert field in str(info.value)


def test_socket_mode_needs_a_local_agent_image() -> None:
    with pytest.raises(InvalidArgument, match="local image"):
        parse_bottle_spec("b1", doc(mode="socket", agent__image="docker.io/library/alpine"))
    assert parse_bottle_spec("b1", doc(mode="socket")).mode == "socket"


def test_a_volumes_host_directory_is_not_looked_at_when_the_spec_is_read() -> None:
    """The host side is the create's to resolve, once (``volumes.py``): a kept bottle whose
    volume went away is still read back; the syntax is checked here."""
    spec = parse_bottle_spec("b1", doc(agent__volumes=["/nonexistent-dir-xyz:/work"]))
    assert spec.agent is not None and spec.agent.volumes == ("/nonexistent-dir-xyz:/work:ro",)


@pytest.mark.parametrize(
    ("host", "canonical"),
    [
        ("api.anthropic.com", "api.anthropic.com"),
        ("*.github.com", "*.github.com"),
        ("bücher.example", "xn--bcher-kva.example"),
        # IDNA 2008: ß is its own letter (IDNA 2003 folded it to "fass.de", another domain).
        ("faß.de", "xn--fa-hia.de"),
        ("xn--fa-hia.de", "xn--fa-hia.de"),
    ],
)
def test_good_hosts(host: str, canonical: str) -> None:
    assert check_egress_host(host) == canonical


@pytest.mark.parametrize(
    "host",
    [
        "",
        "localhost",
        "API.example.com",
        "a..b",
        "-a.com",
        "a-.com",
        "*.",
        "*",
        "a.*.com",
        "1.2.3.4",
        "exa mple.com",
        "a.com.",
        "x" * 64 + ".com",
        "a.com/path",
        "a.com:443",
        None,
        # Issue 13 item 9: no silent folding, no invalid punycode.
        "\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45.com",  # fullwidth "example"
        "example。com",
        "xn--zz.com",
        "xn--a.com",
    ],
)
def test_bad_hosts(host: object) -> None:
    with pytest.raises(InvalidArgument):
        check_egress_host(host)


def test_image_rules_follow_smolvm_and_route_packed_machines_to_from() -> None:
    from bottlenet.bottles.spec import image_fields, is_local_image

    for local in ("/img.tar", "./dir", "../x", "a.tar.gz", "b.tgz", "-", "/m.smolmachine"):
        assert is_local_image(local), local
    for remote in ("docker.io/library/alpine", "alpine:3", "ghcr.io/x/y:tag"):
        assert not is_local_image(remote), remote
    assert image_fields("/m.smolmachine") == {"from_file": "/m.smolmachine"}
    assert image_fields("/img.tar") == {"image": "/img.tar"}


@pytest.mark.parametrize(
    "template",
    [
        "{host:>100000000}",
        "{port:0>99999}",
        "{host!r}",
        "{host!s:>9}",
        "{host.__class__}",
        "{socket[0]}",
        "{}",
        "{0}",
        "x" * 4000 + "{socket}",
    ],
)
def test_templates_are_bare_fields_with_a_bounded_value(template: str) -> None:
    """Issue 13 item 4: a tiny spec cannot make the daemon allocate an unbounded string."""
    services = [{"name": "e", "guest_port": 1, "env": [f"X={template}"]}]
    with pytest.raises(InvalidArgument, match=r"^sidecar\.service\[0\]\.env\[0\]: "):
        parse_bottle_spec("b1", doc(sidecar__service=services))


def test_stamped_env_total_is_bounded() -> None:
    env = [f"X{i}=" + "{socket}" * 30 for i in range(128)]
    services = [{"name": f"s{j}", "guest_port": 1 + j, "env": env} for j in range(16)]
    with pytest.raises(InvalidArgument, match="could stamp more than"):
        parse_bottle_spec("b1", doc(sidecar__service=services))


def test_stamp_is_plain_substitution() -> None:
    from bottlenet.bottles.spec import stamp_template

    fields = {"host": "127.77.0.2", "port": "41000", "socket": "/s", "service": "egress"}
    assert stamp_template("http://{host}:{port}/{service}", fields) == (
        "http://127.77.0.2:41000/egress"
    )
    assert stamp_template("{{literal}}", fields) == "{literal}"


def test_volumes_default_to_read_only() -> None:
    """``HOST:GUEST`` is read-only; ``:rw`` must be written."""
    spec = parse_bottle_spec("b1", doc(agent__volumes=["/w:/w", "/w:/x:rw"]))
    assert spec.agent is not None
    assert spec.agent.volumes == ("/w:/w:ro", "/w:/x:rw")


def test_transparent_egress_names_a_sidecar_service_in_socket_mode() -> None:
    """``agent.transparent_egress``: absent means no layer; it must name a service; a
    bottle in alias mode (whose agent has a network) cannot have it."""
    assert parse_bottle_spec("b", doc()).agent.transparent_egress is None  # type: ignore[union-attr]
    spec = parse_bottle_spec("b", doc(agent__transparent_egress="egress"))
    assert spec.agent is not None and spec.agent.transparent_egress == "egress"
    with pytest.raises(InvalidArgument, match=r"agent\.transparent_egress: must name one of"):
        parse_bottle_spec("b", doc(agent__transparent_egress="proxy"))
    with pytest.raises(InvalidArgument, match=r"agent\.transparent_egress: needs socket mode"):
        parse_bottle_spec("b", doc(mode="alias", agent__transparent_egress="egress"))
    with pytest.raises(InvalidArgument, match=r"agent\.transparent_egress"):
        parse_bottle_spec("b", doc(agent__transparent_egress=""))
