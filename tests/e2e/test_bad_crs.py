"""Bad InferenceServices are rejected at admission, by the real API server, naming the field.

Only the CRD is installed (no operator): each spec of tests/operator/invalid_specs.yaml is sent
with `kubectl create --dry-run=server`, as a user's `kubectl apply` would be (kubectl asks for
strict field validation, so unknown fields are errors, not silently dropped), and the error must
name the case's field and say its words. tests/operator/test_spec_models.py holds the operator's
own check to the same table.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from kvpilot import kube_contract
from kvpilot.operator import crd, spec

pytestmark = pytest.mark.e2e

INVALID = yaml.safe_load((crd.REPO_ROOT / "tests" / "operator" / "invalid_specs.yaml").read_text())
NAMESPACE = "default"


@pytest.fixture(scope="module")
def cluster(local_cluster):
    """The local control plane with the CRD installed and established."""
    local_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd.CRD_PATHS[0]))
    local_cluster.kubectl("wait", "--for=condition=Established", f"crd/{kube_contract.PLURAL}.{kube_contract.GROUP}",
                          "--timeout=60s")
    return local_cluster


def _dry_run_create(cluster, resource_spec: dict, name: str = "bad"):
    manifest = {"apiVersion": kube_contract.API_VERSION, "kind": kube_contract.KIND,
                "metadata": {"name": name, "namespace": NAMESPACE}, "spec": resource_spec}
    return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)


@pytest.fixture(scope="module")
def rejections(cluster) -> dict[str, str]:
    """case -> what the API server answered (stderr), for every case, four kubectl calls at a time."""
    def answer(case):
        result = _dry_run_create(cluster, case["spec"])
        return result.stderr if result.returncode != 0 else f"ACCEPTED: {result.stdout}"

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip((c["case"] for c in INVALID), pool.map(answer, INVALID)))


def test_a_valid_service_is_admitted(cluster):
    """The control: the same request with a good spec passes, so the rejections below are the spec's."""
    result = _dry_run_create(cluster, {"model": {"uri": "pvc://models/llama"}, "replicas": 2,
                                       "resources": {"cpu": "3500m", "memory": "32Gi"},
                                       "autoscaling": {"maxReplicas": 4},
                                       "tuning": {"slo": {"itlP99Seconds": 0.1}}}, name="good")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("case", INVALID, ids=[c["case"] for c in INVALID])
def test_invalid_service_is_rejected_naming_the_field(rejections, case):
    answer = rejections[case["case"]]
    assert not answer.startswith("ACCEPTED"), f"the API server admitted {case['spec']}"
    assert case["field"] in answer and case["message"] in answer, answer


def test_long_name_is_rejected(cluster):
    result = _dry_run_create(cluster, {"model": {"uri": "pvc://m"}}, name="x" * 60)
    assert result.returncode != 0 and spec.NAME_RULE.message in result.stderr, result.stderr
