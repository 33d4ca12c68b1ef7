"""The chart's transport and network rules (docs/install.md "Transport" and "NetworkPolicy").

- tls.enabled=false is refused by the real `helm` with a message that says why (a bearer token never
  travels in the clear), and so is a plain-http controller.url; the default renders HTTPS only.
- The NetworkPolicies: who reaches the controller's port (the agents by address, since they are
  hostNetwork, and the monitoring namespace) and the agents' port (the monitoring namespace, every
  other port left open), for each way of naming the agents' addresses; the real kube-apiserver
  accepts every rendering (server-side dry run).
"""
from __future__ import annotations

import json

import pytest
import yaml

from tests.test_deploy import CHART, NAMESPACE, find, helm, helm_template, pod_spec

CONTROLLER_PORT = 9561
AGENT_PORT = 9560
MONITORING = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}


# --- item 3: one transport, HTTPS ---------------------------------------------------------------


# `helm lint` runs templates in lint mode, where `fail` only logs: install, upgrade and template refuse
@pytest.mark.parametrize("command", [["template", "netagent"], ["install", "--dry-run=client", "netagent"]])
def test_tls_disabled_is_refused_saying_why(command):
    result = helm(*command, str(CHART), "--set", "tls.enabled=false", check=False)
    assert result.returncode != 0, f"helm {command[0]} accepted tls.enabled=false"
    output = result.stdout + result.stderr
    assert "tls.enabled=false is refused" in output, output[-800:]
    assert "must never travel in the clear" in output and "401" in output, output[-800:]


def test_plain_http_controller_url_is_refused():
    result = helm("template", "netagent", str(CHART), "--set", "controller.url=http://controller.example:9561",
                  check=False)
    assert result.returncode != 0
    assert "controller.url=http://controller.example:9561 is refused" in result.stderr, result.stderr[-800:]
    assert "must be an https:// URL" in result.stderr
    docs = helm_template("--set", "controller.url=https://controller.example:9561")
    agent, = pod_spec(docs, "DaemonSet", "netagent-agent")["containers"]
    assert "--controller=https://controller.example:9561" in agent["args"]


def test_default_install_speaks_https_only():
    docs = helm_template()
    agent, = pod_spec(docs, "DaemonSet", "netagent-agent")["containers"]
    controller, = pod_spec(docs, "Deployment", "netagent-controller")["containers"]
    assert f"--controller=https://netagent-controller.{NAMESPACE}.svc:{CONTROLLER_PORT}" in agent["args"]
    assert "--controller-ca=/etc/netagent/controller-ca/ca.crt" in agent["args"]
    assert "--tls-secret=netagent-controller-tls" in controller["args"]
    rendered = yaml.safe_dump_all(docs)
    assert "insecure-http" not in rendered and "no-auth" not in rendered


# --- item 6: NetworkPolicies ----------------------------------------------------------------------


def policies(*args: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in helm_template(*args) if d["kind"] == "NetworkPolicy"}


def controller_rules(policy: dict) -> tuple[list[dict], list[dict]]:
    """(the agents' peers, the monitoring peers) of the controller's policy."""
    agents, monitoring = policy["spec"]["ingress"]
    for rule in (agents, monitoring):
        assert rule["ports"] == [{"protocol": "TCP", "port": CONTROLLER_PORT}]
    return agents["from"], monitoring["from"]


def test_default_policies_admit_agents_and_monitoring_only():
    docs = helm_template()
    found = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert set(found) == {"netagent-controller", "netagent-agent"}
    controller = found["netagent-controller"]["spec"]
    assert controller["podSelector"]["matchLabels"] == \
        find(docs, "Deployment", "netagent-controller")["spec"]["selector"]["matchLabels"]
    assert controller["policyTypes"] == ["Ingress"]  # the controller still reaches the API server
    agents, monitoring = controller_rules(found["netagent-controller"])
    # no podCIDRs, no agentCIDRs: every address (the policy cannot tell agents from pods: the docs say so)
    assert agents == [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]
    assert monitoring == [{"namespaceSelector": MONITORING}]

    agent = found["netagent-agent"]["spec"]
    assert agent["podSelector"]["matchLabels"] == \
        find(docs, "DaemonSet", "netagent-agent")["spec"]["selector"]["matchLabels"]
    scrape, others = agent["ingress"]
    assert scrape == {"from": [{"namespaceSelector": MONITORING}], "ports": [{"protocol": "TCP", "port": AGENT_PORT}]}
    # the node's every other port stays open, from anywhere, where a CNI enforces this on hostNetwork
    assert "from" not in others
    assert others["ports"] == [
        {"protocol": "TCP", "port": 1, "endPort": AGENT_PORT - 1},
        {"protocol": "TCP", "port": AGENT_PORT + 1, "endPort": 65535},
        {"protocol": "UDP", "port": 1, "endPort": 65535},
        {"protocol": "SCTP", "port": 1, "endPort": 65535}]


def test_pod_cidrs_are_excepted_per_family():
    found = policies("--set", "podCIDRs={10.100.0.0/14,fd00:10::/48,10.200.0.0/16}")
    agents, _ = controller_rules(found["netagent-controller"])
    assert agents == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.100.0.0/14", "10.200.0.0/16"]}},
                      {"ipBlock": {"cidr": "::/0", "except": ["fd00:10::/48"]}}]


def test_agent_cidrs_name_the_nodes_exactly():
    found = policies("--set", "podCIDRs={10.100.0.0/14},networkPolicy.agentCIDRs={192.0.2.0/24,2001:db8::/64}",
                     "--set", "controller.port=8443")
    agents, _ = found["netagent-controller"]["spec"]["ingress"]
    assert agents["from"] == [{"ipBlock": {"cidr": "192.0.2.0/24"}}, {"ipBlock": {"cidr": "2001:db8::/64"}}]
    assert agents["ports"] == [{"protocol": "TCP", "port": 8443}]


def test_monitoring_selector_and_extra_peers_are_values():
    selector = {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}
    peer = {"namespaceSelector": {"matchLabels": {"example.org/host-network": "true"}}}
    found = policies("--set-json", f"networkPolicy.monitoringNamespaceSelector={json.dumps(selector)}",
                     "--set-json", 'networkPolicy.extraControllerPeers=[{"namespaceSelector":{"matchLabels":{"example.org/host-network":"true"}}}]',
                     "--set", "networkPolicy.agentCIDRs={192.0.2.0/24}")
    agents, monitoring = controller_rules(found["netagent-controller"])
    assert agents == [{"ipBlock": {"cidr": "192.0.2.0/24"}}, peer]
    assert monitoring == [{"namespaceSelector": selector}]
    assert found["netagent-agent"]["spec"]["ingress"][0]["from"] == [{"namespaceSelector": selector}]


@pytest.mark.parametrize("port,ranges", [
    (1, [{"protocol": "TCP", "port": 2, "endPort": 65535}]),
    (65535, [{"protocol": "TCP", "port": 1, "endPort": 65534}]),
])
def test_agent_port_at_either_end_of_the_range(port, ranges):
    others = policies("--set", f"agent.port={port}")["netagent-agent"]["spec"]["ingress"][1]
    assert others["ports"][:-2] == ranges


@pytest.mark.parametrize("args", [["--set", "networkPolicy.enabled=false"], ["--set", "cleanup=true"]])
def test_no_policies_when_off_or_cleaning_up(args):
    assert policies(*args) == {}


@pytest.mark.parametrize("bad", [
    ["--set", "networkPolicy.agentCIDRs={nodes}"],
    ["--set-json", 'networkPolicy.monitoringNamespaceSelector={"matchLabels":null}'],  # {}: every namespace
    ["--set-json", 'networkPolicy.extraControllerPeers=[{"everyone":true}]'],
    ["--set", "networkPolicy.enable=true"],
    ["--set", "networkPolicy.cilium=maybe"],
])
def test_values_schema_refuses_bad_policy_values(bad):
    result = helm("template", "netagent", str(CHART), *bad, check=False)
    assert result.returncode != 0, f"helm template accepted {bad}"
    # the schema, or templates/validate-values.yaml for a value of the wrong shape (naming it, with an example)
    assert ("don't meet the specifications of the schema" in result.stderr
            or ("is refused: expected" in result.stderr and "e.g." in result.stderr)), result.stderr[-800:]


VARIANTS = {
    "default": [],
    "pod-cidrs": ["--set", "podCIDRs={10.100.0.0/14,fd00:10::/48}"],
    "agent-cidrs": ["--set", "networkPolicy.agentCIDRs={192.0.2.0/24,2001:db8::/64}"],
    "extra-peers": ["--set-json", 'networkPolicy.extraControllerPeers=[{"namespaceSelector":{"matchLabels":{"a":"b"}},"podSelector":{}}]'],
    "port-edges": ["--set", "agent.port=65535,controller.port=1"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kube_apiserver_accepts_the_policies(kube_api, kube_namespace, variant):
    """The rendered policies through the real API server's validation (a server-side dry run in a
    namespace of the test's own), e.g. that each `except` lies inside its `cidr`."""
    out = helm("template", "netagent", str(CHART), "--namespace", kube_namespace, *VARIANTS[variant],
               "--show-only", "templates/networkpolicy.yaml").stdout
    result = kube_api.kubectl("apply", "--dry-run=server", "-f", "-", input=out, check=False)
    assert result.returncode == 0, result.stderr
    assert "networkpolicy.networking.k8s.io/netagent-controller created (server dry run)" in result.stdout
    assert "networkpolicy.networking.k8s.io/netagent-agent created (server dry run)" in result.stdout


def test_kube_apiserver_refuses_an_except_outside_its_cidr(kube_api, kube_namespace):
    """The dry run above can fail: the same API server refuses a policy the chart must never render."""
    out = helm("template", "netagent", str(CHART), "--namespace", kube_namespace,
               "--show-only", "templates/networkpolicy.yaml").stdout
    broken = out.replace("cidr: 0.0.0.0/0", "cidr: 0.0.0.0/0\n            except: [\"0.0.0.0/0\"]", 1)
    assert broken != out
    result = kube_api.kubectl("apply", "--dry-run=server", "-f", "-", input=broken, check=False)
    assert result.returncode != 0 and "except" in result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize("args,rendered", [
    ([], False),  # auto, and the cluster serves no CiliumNetworkPolicy
    (["--api-versions", "cilium.io/v2/CiliumNetworkPolicy"], True),  # auto on a Cilium cluster
    (["--set", "networkPolicy.cilium=true"], True),
    (["--set", "networkPolicy.cilium=false", "--api-versions", "cilium.io/v2/CiliumNetworkPolicy"], False),
    (["--set", "networkPolicy.enabled=false", "--api-versions", "cilium.io/v2/CiliumNetworkPolicy"], False),
])
def test_cilium_admits_the_agents_by_node_identity(args, rendered):
    """On Cilium an ipBlock selects nodes only with policy-cidr-match-mode=nodes: a CiliumNetworkPolicy
    admits the agents (host, remote-node) to the controller's port, and nothing else. Structure only:
    no Cilium CRD here to validate it against."""
    docs = helm_template(*args)
    cilium = [d for d in docs if d["kind"] == "CiliumNetworkPolicy"]
    if not rendered:
        assert cilium == []
        return
    policy, = cilium
    assert policy["apiVersion"] == "cilium.io/v2" and policy["metadata"]["namespace"] == NAMESPACE
    assert policy["spec"] == {
        "endpointSelector": {"matchLabels": {"app.kubernetes.io/name": "netagent-controller"}},
        "ingress": [{"fromEntities": ["host", "remote-node"],
                     "toPorts": [{"ports": [{"port": str(CONTROLLER_PORT), "protocol": "TCP"}]}]}]}
