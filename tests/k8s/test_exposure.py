"""The hub gets an address only with an authenticator and HTTPS: values.yaml keeps proxy-public private,
public.yaml exposes it with both, and k8s/README.md's commands, in reading order, never show an
address before both are set."""

from __future__ import annotations

import copy
import re
import shlex

import jsonschema
import pytest
import yaml

from tests._support.readme import blocks
from tests.k8s._k8s import (
    CHART_VERSION,
    K8S,
    PUBLIC_VALUES,
    ROOT,
    helm_merge,
    merged_values,
    own_values,
    schema,
)

README = K8S / "README.md"
VALUES_SCHEMA = schema(f"z2jh-{CHART_VERSION}.values.schema.json")


def exposed(values: dict) -> bool:
    """proxy-public (or an ingress) reachable from outside the cluster."""
    return values["proxy"]["service"]["type"] in ("LoadBalancer", "NodePort") or bool(
        values.get("ingress", {}).get("enabled")
    )


def secured(values: dict) -> str | None:
    """None when users must log in with a real authenticator over HTTPS; else what is missing."""
    auth = values["hub"].get("config", {}).get("JupyterHub", {}).get("authenticator_class")
    if auth in (None, "dummy", "null", "jupyterhub.auth.DummyAuthenticator"):
        return f"authenticator_class is {auth!r}: anyone may log in with any password"
    https = values["proxy"]["https"]
    ingress = values.get("ingress", {})
    if ingress.get("enabled"):
        return None if ingress.get("tls") else "an ingress without tls"
    if not https.get("enabled") or not https.get("hosts"):
        return "proxy.https is not enabled with a host: logins and tokens would cross the network in clear"
    if https.get("type", "letsencrypt") == "letsencrypt" and not https["letsencrypt"].get("contactEmail"):
        return "proxy.https.letsencrypt.contactEmail is not set: no certificate is issued"
    return None


def public_values() -> dict:
    return yaml.safe_load(PUBLIC_VALUES.read_text())


def test_the_default_values_give_proxy_public_no_address():
    values = merged_values()
    assert values["proxy"]["service"]["type"] == "ClusterIP"
    assert not exposed(values), "values.yaml alone exposes the hub"
    # which matters: the chart's default authenticator lets anyone in
    assert secured(values) is not None


def test_public_values_set_an_authenticator_and_https_with_the_address():
    values = merged_values(helm_merge(own_values(), public_values()))
    jsonschema.validate(values, VALUES_SCHEMA)
    assert exposed(values)
    assert secured(values) is None, secured(values)
    assert values["hub"]["config"]["JupyterHub"]["authenticator_class"] == "github"
    # the OAuth app's secret is never in git: the README passes it with --set
    assert "client_secret" not in PUBLIC_VALUES.read_text().split("#")[0]


@pytest.mark.parametrize(
    "drop",
    [("hub", "config", "JupyterHub"), ("proxy", "https")],
    ids=["without the authenticator", "without https"],
)
def test_the_check_catches_an_address_without_one_of_them(drop):
    public = copy.deepcopy(public_values())
    *parents, last = drop
    node = public
    for key in parents:
        node = node[key]
    del node[last]
    values = merged_values(helm_merge(own_values(), public))
    assert exposed(values) and secured(values) is not None


def helm_commands() -> list[tuple[int, str]]:
    """(line, command) of every `helm upgrade` in k8s/README.md, in reading order, continuations joined."""
    out = []
    for b in blocks(README):
        if b.kind != "shell":
            continue
        for i, cmd in enumerate(re.split(r"(?<!\\)\n", b.code)):
            cmd = cmd.replace("\\\n", " ")
            if re.match(r"\s*helm upgrade", cmd):
                out.append((b.line + i, cmd.split("#", 1)[0]))
    return out


def values_of(command: str) -> dict:
    """The values a `helm upgrade` line installs: its --values files in order, then its --set's."""
    words = shlex.split(command)
    own: dict = {}
    for flag, arg in zip(words, words[1:], strict=False):
        if flag in ("--values", "-f"):
            own = helm_merge(own, yaml.safe_load((ROOT / arg).read_text()))
        elif flag == "--set":
            key, _, value = arg.partition("=")
            node = own
            *parents, last = key.split(".")
            for k in parents:
                node = node.setdefault(k, {})
            node[last] = value
    return merged_values(own)


def test_the_readme_sets_the_authenticator_and_https_before_the_hub_gets_an_address():
    commands = helm_commands()
    assert len(commands) >= 2, commands
    first_line, first = commands[0]
    assert "--install" in first and not exposed(values_of(first)), (
        "the first install must keep the hub private"
    )
    text = README.read_text().splitlines()
    forward = next(i for i, ln in enumerate(text, 1) if "port-forward service/proxy-public" in ln)
    assert forward > first_line, "show how to reach the private hub (port-forward) after installing it"
    exposing = [line for line, cmd in commands if exposed(values_of(cmd))]
    assert exposing, "the README never gives the hub an address"
    for line, cmd in commands:
        values = values_of(cmd)
        if exposed(values):
            assert secured(values) is None, f"k8s/README.md:{line} exposes proxy-public: {secured(values)}"
    # the external address is looked up only once a secured command has given it one
    for i, ln in enumerate(text, 1):
        if "get service proxy-public" in ln or "EXTERNAL-IP" in ln:
            assert i > exposing[0], f"k8s/README.md:{i} shows the address before it is secured"
