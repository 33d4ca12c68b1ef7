"""`netagent plan` end to end, as a user runs it (subprocess), on the example files and on bad input."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from controller import whatif

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"

POLICY = """
apiVersion: netagent.io/v1alpha1
kind: EgressClass
metadata: {name: gold}
spec: {weight: 2, min: 10M, max: 100M}
---
apiVersion: netagent.io/v1alpha1
kind: EgressBudget
metadata: {name: default}
spec:
  total: 100M
  teams:
  - {name: a, namespaces: [a], weight: 3}
  - {name: b, namespaces: [b], weight: 1, allowedClasses: [default]}
---
apiVersion: v1
kind: Pod
metadata: {name: ignored}
"""


def plan(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "netagent", "plan", *map(str, args)], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def policy(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    return path


def write(tmp_path, text, name="demand.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_json_output_is_the_fair_allocation(tmp_path, policy):
    demand = write(tmp_path, "namespace,pod,class,demand\na,p1,gold,1G\na,p2,,5M\nb,q1,,1G\n")
    done = plan("--from-file", policy, "--demand", demand, "-o", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["namespace"], r["pod"], r["team"], r["class"]) for r in rows] == [
        ("a", "p1", "a", "gold"), ("a", "p2", "a", "default"), ("b", "q1", "b", "default")]
    by_pod = {r["pod"]: r for r in rows}
    # a:b = 3:1 -> 75M/25M; inside a, p2 wants 5M, p1 (capped at 100M by gold) takes the other 70M
    assert by_pod["p1"]["allocation"] == 70_000_000 and by_pod["p2"]["allocation"] == 5_000_000
    assert by_pod["q1"]["allocation"] == 25_000_000 and by_pod["p1"]["demand"] == 1_000_000_000
    assert all(r["limit"] >= r["allocation"] for r in rows)
    assert sum(r["limit"] for r in rows) <= 100_000_000


def test_table_is_the_default_and_problems_are_warnings(tmp_path, policy):
    demand = write(tmp_path, "namespace,pod,class,demand,bandwidth\n# a comment\nb,q1,gold,1G,\na,p1,,10M,2M\n")
    done = plan("-f", policy, "-d", demand)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["NAMESPACE", "POD", "TEAM", "CLASS", "DEMAND", "ALLOCATION", "LIMIT"]
    assert lines[1].split()[:5] == ["b", "q1", "b", "default", "1G"]
    assert lines[2].split()[4:6] == ["10M", "2M"]  # the bandwidth column caps p1
    assert "budget default: total 100M" in done.stdout
    assert f"{demand}:3: EgressClassNotAllowed" in done.stderr



DOWNLOAD_POLICY = POLICY.replace("spec: {weight: 2, min: 10M, max: 100M}",
                                 "spec: {weight: 2, min: 10M, max: 100M, ingress: {weight: 1, max: 30M}}").replace(
    "  total: 100M\n", "  total: 100M\n  ingressTotal: 40M\n").replace(
    "{name: b, namespaces: [b], weight: 1,", "{name: b, namespaces: [b], weight: 1, ingress: {weight: 3},")


def test_downloads_are_planned_with_their_own_total_and_weights(tmp_path):
    """ingress_demand plans downloads against ingressTotal (40M) with the download weights: teams a:b =
    3:3 (a's from its upload weight), gold's download cap 30M; ingress_bandwidth lowers a pod's cap."""
    path = write(tmp_path, DOWNLOAD_POLICY, "policy.yaml")
    demand = write(tmp_path, "namespace,pod,class,demand,ingress_demand,ingress_bandwidth\n"
                             "a,p1,gold,1G,1G,\na,p2,,5M,1G,4M\nb,q1,,1G,1G,\nb,q2,,1G,,\n")
    done = plan("-f", path, "-d", demand, "-o", "json")
    assert done.returncode == 0, done.stderr
    by_pod = {r["pod"]: r for r in json.loads(done.stdout)}
    assert by_pod["q1"]["ingress_allocation"] == 20_000_000  # b: half the download total, q2 wants none
    assert by_pod["q2"]["ingress_demand"] == 0 and by_pod["q2"]["ingress_allocation"] == 0
    assert by_pod["p2"]["ingress_allocation"] == 4_000_000  # its ingress_bandwidth
    assert by_pod["p1"]["ingress_allocation"] == 16_000_000  # the rest of a's 20M, under gold's 30M cap
    assert by_pod["p1"]["allocation"] == 70_000_000  # uploads as without downloads
    assert sum(r["ingress_limit"] for r in by_pod.values()) <= 40_000_000

    done = plan("-f", path, "-d", demand, "-o", "wide")
    assert done.returncode == 0, done.stderr
    head = done.stdout.splitlines()[0].split()
    assert head[7:10] == ["INGRESS-DEMAND", "INGRESS-ALLOCATION", "INGRESS-LIMIT"] and head[-1] == "INGRESS-CAP"
    assert "downloads (spec.ingressTotal): total 40M, allocated 40M" in done.stdout
    teams = [line.split() for line in done.stdout.splitlines() if line.startswith("TEAM")]
    assert teams[1][:3] == ["TEAM", "INGRESS-WEIGHT", "INGRESS-PODS"]
    assert ["b", "3", "2", "1G", "0", "20M", "20M"] in [line.split() for line in done.stdout.splitlines()]


@pytest.mark.parametrize("row, message", [
    ("a,p1,,1M,-5M,", ":2: ingress_demand: '-5M' is negative"),
    ("a,p1,,1M,5Mbit,", ":2: ingress_demand: '5Mbit'"),
])
def test_bad_download_demand_names_file_and_line(tmp_path, policy, row, message, capsys):
    demand = write(tmp_path, f"namespace,pod,class,demand,ingress_demand,ingress_bandwidth\n{row}\n")
    assert whatif.run(from_file=[str(policy)], demand=str(demand), output="table") == 2
    assert message in capsys.readouterr().err


def test_bad_ingress_bandwidth_is_a_warning_naming_the_annotation(tmp_path, policy, capsys):
    demand = write(tmp_path, "namespace,pod,class,demand,ingress_demand,ingress_bandwidth\na,p1,,1M,5M,fast\n")
    assert whatif.run(from_file=[str(policy)], demand=str(demand), output="json") == 0
    out, err = capsys.readouterr()
    assert ":2: InvalidIngressBandwidth: annotation kubernetes.io/ingress-bandwidth" in err
    assert json.loads(out)[0]["ingress_allocation"] == 5_000_000  # the class's download values: no cap


def test_wide_table_explains_each_pod(tmp_path, policy, capsys):
    demand = write(tmp_path, "namespace,pod,class,demand,bandwidth\na,p1,gold,1G,50M\n")
    assert whatif.run(from_file=[str(policy)], demand=str(demand), output="wide") == 0
    head, row = capsys.readouterr().out.splitlines()[:2]
    assert head.split()[-3:] == ["WEIGHT", "GUARANTEE", "CAP"]
    assert row.split()[-3:] == ["2", "10M", "50M"]  # gold's weight and min; the bandwidth column's cap


def test_the_shipped_examples_run(tmp_path):
    done = plan("-f", EXAMPLES / "policy.yaml", "-d", EXAMPLES / "demand.csv", "-o", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert len(rows) == 8 and sum(r["allocation"] for r in rows) == pytest.approx(1e9)
    # downloads: the ingress_demand column against spec.ingressTotal (500M), bulk's download cap 50M
    assert sum(r["ingress_allocation"] for r in rows) == pytest.approx(500e6)
    assert {r["pod"]: r["ingress_allocation"] for r in rows}["crawler-0"] == pytest.approx(50e6)


def test_demand_from_stdin_and_no_budget(tmp_path):
    path = write(tmp_path, "apiVersion: netagent.io/v1alpha1\nkind: EgressClass\nmetadata: {name: slow}\n"
                           "spec: {max: 1M}\n", "classes.yaml")
    done = plan("-f", path, "-d", "-", "-o", "json", stdin="namespace,pod,class,demand\nx,y,slow,5M\n")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [{"namespace": "x", "pod": "y", "team": "default", "class": "slow",
                                        "demand": 5_000_000, "allocation": 1_000_000, "limit": 1_000_000}]


@pytest.mark.parametrize("csv_text, message", [
    ("namespace,pod,class,demand\na,p1,,10Mbit\n", ":2: demand: '10Mbit' is not a Kubernetes quantity"),
    ("namespace,pod,klass,demand\n", ":1: header must name the columns namespace,pod,class,demand"),
    ("namespace,pod,class\n", "missing: demand"),
    ("namespace,pod,class,demand,colour\n", "unknown: colour"),
    ("namespace,pod,class,demand\n\na,p1,,1M\na,p1,,2M\n", ":4: pod a/p1 already given on line 3"),
    ("namespace,pod,class,demand\na,p1,1M\n", ":2: 3 fields, the header has 4"),
    ("namespace,pod,class,demand\n,p1,,1M\n", ":2: namespace and pod must not be empty"),
    ("", "empty; expected a header line"),
])
def test_bad_csv_names_file_and_line(tmp_path, policy, csv_text, message, capsys):
    demand = write(tmp_path, csv_text)
    # in-process (the same run() the CLI calls): eight interpreter start-ups would dominate this file's time
    assert whatif.run(from_file=[str(policy)], demand=str(demand), output="table") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("netagent plan: error: ")
    assert message in err and str(demand) in err


def test_bad_csv_through_the_cli(tmp_path, policy):
    demand = write(tmp_path, "namespace,pod,class,demand\na,p1,,-5M\n")
    done = plan("-f", policy, "-d", demand)
    assert done.returncode == 2 and done.stdout == ""
    assert f"netagent plan: error: {demand}:2: demand: '-5M' is negative" in done.stderr


def test_bad_yaml_and_missing_files(tmp_path):
    bad = write(tmp_path, "kind: EgressClass\nmetadata: {name: x\nspec: {}\n", "bad.yaml")
    demand = write(tmp_path, "namespace,pod,class,demand\n")
    done = plan("-f", bad, "-d", demand)
    assert done.returncode == 2 and f"{bad}:" in done.stderr and "not valid YAML" in done.stderr
    done = plan("-f", tmp_path / "nope.yaml", "-d", demand)
    assert done.returncode == 2 and "nope.yaml: cannot read" in done.stderr
    done = plan("-f", write(tmp_path, "- just\n- a list\n", "list.yaml"), "-d", demand)
    assert done.returncode == 2 and "must be a Kubernetes object" in done.stderr


def test_policy_from_a_directory(tmp_path, policy, capsys):
    demand = write(tmp_path, "namespace,pod,class,demand\na,p1,gold,1G\n")
    assert whatif.run(from_file=[str(tmp_path)], demand=str(demand), output="json") == 0
    assert json.loads(capsys.readouterr().out)[0]["allocation"] == 100_000_000  # gold's max, within a's 100M


def test_bad_policy_objects_are_warnings_not_errors(tmp_path, policy):
    extra = write(tmp_path, "kind: EgressClass\nmetadata: {name: broken}\nspec: {weight: 0}\n", "extra.yaml")
    done = plan("-f", policy, "-f", extra, "-d", write(tmp_path, "namespace,pod,class,demand\na,p,,1M\n"))
    assert done.returncode == 0
    assert "EgressClass broken: spec.weight: 0 is not an integer from 1" in done.stderr


def test_a_team_chosen_by_namespace_label_is_planned_as_the_controller_resolves_it(tmp_path):
    """Namespace objects in the policy files give their labels (as to the agent's and the controller's
    --from-file): a team chosen by namespaceSelector gets its pods, not the default team."""
    path = write(tmp_path, """
kind: EgressBudget
metadata: {name: default}
spec:
  total: 100M
  teams: [{name: research, namespaceSelector: {matchLabels: {netagent.io/team: research}}}]
---
kind: Namespace
metadata: {name: lab, labels: {netagent.io/team: research}}
""", "policy.yaml")
    demand = write(tmp_path, "namespace,pod,class,demand\nlab,trainer,,1G\nweb,front,,1G\n")
    done = plan("--from-file", path, "--demand", demand, "-o", "json")
    assert done.returncode == 0, done.stderr
    assert {r["pod"]: r["team"] for r in json.loads(done.stdout)} == {"trainer": "research", "front": "default"}


QUOTA_POLICY = """
apiVersion: netagent.io/v1alpha1
kind: EgressBudget
metadata: {name: default}
spec:
  total: 100M
  teams:
  - {name: a, namespaces: [a], weight: 3, quota: {period: Day, bytes: 750M, exhaustedRate: 10M}}
  - {name: b, namespaces: [b], weight: 1, quota: {period: Day, bytes: 1G}}
  - {name: c, namespaces: [c], weight: 1}
"""
QUOTA_DEMAND = "namespace,pod,class,demand\na,p,,1G\nb,q,,1G\n"


def test_used_bytes_say_which_teams_exhaust_first_and_a_spent_quota_is_planned_at_its_exhausted_rate(tmp_path):
    """a (weight 3) gets 75M of 100M and spends its 750 MB in 80 s; then it is held at its 10M exhaustedRate
    and b takes 90M: b's 1 GB, 250 MB spent by then at 25M, lasts 66.7 s more (146.7 s, not the 320 s of
    its first rate)."""
    policy = write(tmp_path, QUOTA_POLICY, "policy.yaml")
    demand = write(tmp_path, QUOTA_DEMAND)
    done = plan("--from-file", policy, "--demand", demand, "--used", "a=0", "--used", "b=0,uploads", "-o", "json")
    assert done.returncode == 0, done.stderr
    quotas = json.loads(done.stdout)["quotas"]
    assert [(q["team"], q["direction"], q["rate_bps"]) for q in quotas] == [("a", "uploads", 75_000_000),
                                                                            ("b", "uploads", 25_000_000)]
    assert quotas[0]["exhausted_in_seconds"] == pytest.approx(80.0)
    assert quotas[1]["exhausted_in_seconds"] == pytest.approx(80 + 750e6 / 11.25e6)
    # a's quota spent already: planned at its exhaustedRate, b takes the share
    done = plan("--from-file", policy, "--demand", demand, "--used", "a=750M")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.split()[:2] == ["a", "p"] and "10M" in line for line in lines), done.stdout
    assert any(line.split()[:2] == ["b", "q"] and "90M" in line for line in lines), done.stdout
    table = lines[lines.index(next(line for line in lines if line.startswith("QUOTAS"))):]
    assert table[1].split()[0] == "a" and "EXHAUSTED now" in table[1], done.stdout
    assert table[2].split()[0] == "b" and "in 1.5 min" in table[2], done.stdout  # 1 GB at 90M: 88.9 s
    assert "never" not in done.stdout and "c " not in "\n".join(table)  # c has no quota


@pytest.mark.parametrize("used, message", [
    ("a", "expected TEAM=BYTES"),
    ("a=lots", "--used 'a=lots'"),
    ("a=-5", "--used 'a=-5'"),
    ("a=9Ei", "--used 'a=9Ei'"),
    ("a=1G,sideways", "direction 'sideways' is not uploads or downloads"),
    ("x=1G", "'x' is not a team of the policy (a, b, c, default)"),
])
def test_bad_used_bytes_are_refused_naming_the_value(tmp_path, used, message):
    policy = write(tmp_path, QUOTA_POLICY, "policy.yaml")
    done = plan("--from-file", policy, "--demand", write(tmp_path, QUOTA_DEMAND), "--used", used)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_used_bytes_of_a_team_without_that_quota_is_a_warning(tmp_path):
    policy = write(tmp_path, QUOTA_POLICY, "policy.yaml")
    done = plan("--from-file", policy, "--demand", write(tmp_path, QUOTA_DEMAND), "--used", "c=1G",
                "--used", "a=1G,downloads")
    assert done.returncode == 0, done.stderr
    assert "team c has no quota on uploads" in done.stderr and "team a has no quota on downloads" in done.stderr
