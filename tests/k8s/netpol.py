"""A small Kubernetes NetworkPolicy evaluator, and the zero-to-jupyterhub chart's own policies.

`allowed(cluster, src, dst, port)` answers what a conforming network plugin (GKE Dataplane V2,
Calico) enforces for one TCP/UDP connection, per the networking.k8s.io/v1 semantics:

- a pod selected by no policy of a direction (Ingress / Egress) is open in that direction;
- a pod selected by at least one policy with that direction in its policyTypes is closed in it,
  except for what some rule of those policies allows (policies are additive, never subtractive);
- policyTypes defaults to [Ingress] plus Egress when the policy has an egress section;
- a peer is a podSelector (the policy's namespace), a namespaceSelector (all pods of matching
  namespaces), both (pods matching in matching namespaces), or an ipBlock (cidr minus except);
  a rule without peers matches every peer, a rule without ports every port;
- a named port is looked up in the destination pod's container ports;
- a connection needs the source's egress and the destination's ingress.
Service ClusterIPs are translated to the backing pod before policies apply, so connections here are
pod to pod (or pod to an outside address).

`chart_policies(values)` renders the hub and singleuser NetworkPolicies of the zero-to-jupyterhub
chart from merged values, following its templates at the pinned version 4.4.0
(jupyterhub/zero-to-jupyterhub-k8s: jupyterhub/templates/hub/netpol.yaml,
jupyterhub/templates/singleuser/netpol.yaml, jupyterhub/templates/_helpers-netpol.tpl; labels from
jupyterhub/templates/_helpers.tpl `jupyterhub.matchLabels`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    ip: str
    ports: dict[str, int] = field(default_factory=dict)  # named container ports


@dataclass
class External:
    """An address outside the cluster's pods (the internet, the metadata server)."""

    name: str
    ip: str


@dataclass
class Cluster:
    namespaces: dict[str, dict[str, str]]  # name -> labels
    pods: list[Pod]
    policies: list[dict]

    def ns_labels(self, ns: str) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": ns, **self.namespaces.get(ns, {})}


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector; {} (or absent matchLabels/matchExpressions) selects everything."""
    selector = selector or {}
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def policy_types(policy: dict) -> list[str]:
    spec = policy["spec"]
    if "policyTypes" in spec:
        return spec["policyTypes"]
    return ["Ingress"] + (["Egress"] if "egress" in spec else [])


def _peer_matches(cluster: Cluster, policy_ns: str, peer: dict, other: Pod | External) -> bool:
    if "ipBlock" in peer:
        ip = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        if ip not in ipaddress.ip_network(block["cidr"]):
            return False
        return not any(ip in ipaddress.ip_network(e) for e in block.get("except") or [])
    if isinstance(other, External):
        return False  # pod/namespace selectors only ever match pods
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], cluster.ns_labels(other.namespace)):
            return False
    elif other.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], other.labels)


def _port_matches(rule_ports: list[dict] | None, dst: Pod | External, port: int, protocol: str) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        if isinstance(want, str):
            if isinstance(dst, Pod) and dst.ports.get(want) == port:
                return True
            continue
        if want <= port <= p.get("endPort", want):
            return True
    return False


def _direction_allows(cluster: Cluster, pod: Pod, direction: str, other, dst, port: int, protocol: str):
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in cluster.policies
        if p["metadata"].get("namespace") == pod.namespace
        and direction in policy_types(p)
        and selects(p["spec"].get("podSelector"), pod.labels)
    ]
    if not selecting:
        return True  # no policy isolates this pod in this direction
    for policy in selecting:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if peers and not any(
                _peer_matches(cluster, policy["metadata"]["namespace"], peer, other) for peer in peers
            ):
                continue
            if _port_matches(rule.get("ports"), dst, port, protocol):
                return True
    return False


def allowed(
    cluster: Cluster, src: Pod | External, dst: Pod | External, port: int, protocol: str = "TCP"
) -> bool:
    if isinstance(src, Pod) and not _direction_allows(cluster, src, "Egress", dst, dst, port, protocol):
        return False
    return not (
        isinstance(dst, Pod) and not _direction_allows(cluster, dst, "Ingress", src, dst, port, protocol)
    )


# --- the zero-to-jupyterhub chart's policies (4.4.0) ------------------------------------------------


def match_labels(component: str, release: str, app: str = "jupyterhub") -> dict[str, str]:
    """`jupyterhub.matchLabels` (legacy labels only, as the chart's selectors use)."""
    return {"component": component, "app": app, "release": release}


def _egress_allow_rules(values: dict, netpol: dict) -> list[dict]:
    """`jupyterhub.networkPolicy.renderEgressRules` in _helpers-netpol.tpl."""
    allow = netpol["egressAllowRules"]
    metadata_ip = values["singleuser"]["cloudMetadata"]["ip"]
    private = [{"ipBlock": {"cidr": c}} for c in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]
    rules = []
    if (
        allow["dnsPortsCloudMetadataServer"]
        or allow["dnsPortsKubeSystemNamespace"]
        or allow["dnsPortsPrivateIPs"]
    ):
        to = []
        if allow["dnsPortsCloudMetadataServer"]:
            to.append({"ipBlock": {"cidr": f"{metadata_ip}/32"}})
        if allow["dnsPortsKubeSystemNamespace"]:
            to.append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}})
        if allow["dnsPortsPrivateIPs"]:
            to.extend(private)
        rules.append({"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}], "to": to})
    if allow["nonPrivateIPs"]:
        rules.append(
            {
                "to": [
                    {
                        "ipBlock": {
                            "cidr": "0.0.0.0/0",
                            "except": [
                                "10.0.0.0/8",
                                "172.16.0.0/12",
                                "192.168.0.0/16",
                                f"{metadata_ip}/32",
                            ],
                        }
                    }
                ]
            }
        )
    if allow["privateIPs"]:
        rules.append({"to": private})
    if allow["cloudMetadataServer"]:
        rules.append({"to": [{"ipBlock": {"cidr": f"{metadata_ip}/32"}}]})
    rules.extend(netpol.get("egress") or [])
    return rules


def _access_from(label: str, port, netpol: dict) -> dict:
    """The "allowed pods (hub.jupyter.org/network-access-...)" ingress rule of hub/singleuser netpol.yaml."""
    source = {"podSelector": {"matchLabels": {label: "true"}}}
    peers = [source]
    if netpol["interNamespaceAccessLabels"] == "accept":
        source["namespaceSelector"] = {"matchLabels": {}}
        peers.append({"namespaceSelector": {"matchLabels": {label: "true"}}})
    return {"ports": [{"port": port}], "from": peers}


def chart_policies(values: dict, release: str, namespace: str) -> list[dict]:
    """The hub and singleuser NetworkPolicies the chart renders for these (merged) values."""
    out = []
    hub_np = values["hub"]["networkPolicy"]
    if hub_np["enabled"]:
        ingress = []
        if hub_np.get("allowedIngressPorts"):
            ingress.append({"ports": [{"port": p} for p in hub_np["allowedIngressPorts"]]})
        ingress.append(_access_from("hub.jupyter.org/network-access-hub", "http", hub_np))
        ingress.extend(hub_np.get("ingress") or [])
        egress = [
            {
                "to": [{"podSelector": {"matchLabels": match_labels("proxy", release)}}],
                "ports": [{"port": 8001}],
            },
            {
                "to": [{"podSelector": {"matchLabels": match_labels("singleuser-server", release)}}],
                "ports": [{"port": 8888}],
            },
            *_egress_allow_rules(values, hub_np),
        ]
        out.append(
            {
                "kind": "NetworkPolicy",
                "metadata": {"name": "hub", "namespace": namespace},
                "spec": {
                    "podSelector": {"matchLabels": match_labels("hub", release)},
                    "policyTypes": ["Ingress", "Egress"],
                    "ingress": ingress,
                    "egress": egress,
                },
            }
        )
    su_np = values["singleuser"]["networkPolicy"]
    if su_np["enabled"]:
        ingress = []
        if su_np.get("allowedIngressPorts"):
            ingress.append({"ports": [{"port": p} for p in su_np["allowedIngressPorts"]]})
        ingress.append(_access_from("hub.jupyter.org/network-access-singleuser", "notebook-port", su_np))
        ingress.extend(su_np.get("ingress") or [])
        egress = [
            {
                "to": [{"podSelector": {"matchLabels": match_labels("hub", release)}}],
                "ports": [{"port": 8081}],
            },
            {
                "to": [{"podSelector": {"matchLabels": match_labels("proxy", release)}}],
                "ports": [{"port": 8000}],
            },
            {
                "to": [{"podSelector": {"matchLabels": match_labels("autohttps", release)}}],
                "ports": [{"port": 8080}, {"port": 8443}],
            },
            *_egress_allow_rules(values, su_np),
        ]
        out.append(
            {
                "kind": "NetworkPolicy",
                "metadata": {"name": "singleuser", "namespace": namespace},
                "spec": {
                    "podSelector": {"matchLabels": match_labels("singleuser-server", release)},
                    "policyTypes": ["Ingress", "Egress"],
                    "ingress": ingress,
                    "egress": egress,
                },
            }
        )
    return out


def user_pod_labels(values: dict, release: str) -> dict[str, str]:
    """Labels KubeSpawner gives a user pod under the chart: its common labels
    (files/hub/jupyterhub_config.py), component singleuser-server (KubeSpawner's default
    component_label) and singleuser.extraLabels."""
    return {
        "app": "jupyterhub",
        "app.kubernetes.io/name": "jupyterhub",
        "release": release,
        "app.kubernetes.io/instance": release,
        "app.kubernetes.io/managed-by": "kubespawner",
        "component": "singleuser-server",
        "hub.jupyter.org/username": "alice",
        **{k: str(v) for k, v in (values["singleuser"].get("extraLabels") or {}).items() if v is not None},
    }
