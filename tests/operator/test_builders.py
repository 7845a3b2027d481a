"""Builders: pure spec -> manifests, checked field by field."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import yaml

from kvpilot.operator import builders, crd, spec, tuning_configmap
from kvpilot.operator.settings import OperatorSettings

SETTINGS = OperatorSettings(engine_image="registry.example/kvpilot:1.2.3")


def _children(spec_dict, name="llama", settings=SETTINGS, state=None):
    parsed = spec.parse_spec(spec_dict)
    state = state or tuning_configmap.settings_in_effect(parsed, None)
    return builders.build_children(name, "ml", parsed, state, settings)


def _engine(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args, flag):
    return args[args.index(flag) + 1]


def test_deployment_runs_kvpilot_serve_with_the_spec():
    children = _children({
        "model": {"uri": "pvc://models/llama-3-8b", "servedName": "llama3"},
        "engine": {"maxNumSeqs": 32, "maxNumBatchedTokens": 4096, "blockSize": 32, "maxModelLen": 2048,
                   "enablePrefixCaching": False, "dtype": "bfloat16", "extraArgs": ["--seed", "7"]},
    })
    container = _engine(children.deployment)
    args = container["args"]
    assert container["command"] == ["kvpilot"] and args[0] == "serve"
    assert args[1] == "/mnt/models/llama-3-8b"
    assert _flag(args, "--host") == "0.0.0.0" and _flag(args, "--port") == "8000"
    assert _flag(args, "--served-model-name") == "llama3"
    assert _flag(args, "--max-num-seqs") == "32"
    assert _flag(args, "--max-num-batched-tokens") == "4096"
    assert _flag(args, "--block-size") == "32" and _flag(args, "--max-model-len") == "2048"
    assert _flag(args, "--dtype") == "bfloat16"
    assert "--no-enable-prefix-caching" in args and "--enable-chunked-prefill" in args
    assert _flag(args, "--tuning-file") == "/etc/kvpilot/tuning/tuning.json"
    assert _flag(args, "--shutdown-grace-period") == str(SETTINGS.engine_shutdown_grace_seconds)
    assert args[-2:] == ["--seed", "7"]
    assert container["image"] == "registry.example/kvpilot:1.2.3"
    token = next(e for e in container["env"] if e["name"] == "KVPILOT_ADMIN_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "llama-admin", "key": "token"}


def test_served_name_defaults_to_the_service_name():
    args = _engine(_children({"model": {"uri": "pvc://m"}}).deployment)["args"]
    assert _flag(args, "--served-model-name") == "llama"


def test_bind_pod_ip_setting_listens_on_the_pod_ip():
    settings = dataclasses.replace(SETTINGS, engine_bind_pod_ip=True)
    container = _engine(_children({"model": {"uri": "pvc://m"}}, settings=settings).deployment)
    assert _flag(container["args"], "--host") == "$(POD_IP)"
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_gpu_requests_limits_and_rollout_without_surge():
    deployment = _children({"model": {"uri": "pvc://m"},
                            "resources": {"gpus": 2, "cpu": 8, "memory": "64Gi"}}).deployment
    resources = _engine(deployment)["resources"]
    assert resources["requests"] == resources["limits"] == {"nvidia.com/gpu": "2", "cpu": "8", "memory": "64Gi"}
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_cpu_only_service_surges_instead():
    deployment = _children({"model": {"uri": "pvc://m"}, "resources": {"gpus": 0}}).deployment
    assert _engine(deployment)["resources"] == {}
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_custom_gpu_resource_name():
    deployment = _children({"model": {"uri": "pvc://m"},
                            "resources": {"gpus": 1, "gpuResourceName": "amd.com/gpu"}}).deployment
    assert _engine(deployment)["resources"]["limits"] == {"amd.com/gpu": "1"}


def test_probes_drain_and_grace_period_match_the_engine():
    deployment = _children({"model": {"uri": "pvc://m"}}).deployment
    container = _engine(deployment)
    pod = deployment["spec"]["template"]["spec"]
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= SETTINGS.engine_startup_seconds
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    drain = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = int(_flag(container["args"], "--shutdown-grace-period"))
    assert pod["terminationGracePeriodSeconds"] > drain + grace


def test_pod_runs_non_root_on_a_read_only_root_filesystem():
    deployment = _children({"model": {"uri": "pvc://m"}}).deployment
    pod = deployment["spec"]["template"]["spec"]
    container = _engine(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/tmp"] == "scratch" and mounts["/etc/kvpilot/tuning"] == "tuning"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tuning"]["configMap"]["name"] == "llama-tuning"
    assert "emptyDir" in volumes["scratch"]


@pytest.mark.parametrize("uri,path,volume", [
    ("pvc://models/llama/v1", "/mnt/models/llama/v1", {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}),
    ("pvc://models", "/mnt/models", {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}),
    ("file:///data/llama", "/mnt/models", {"hostPath": {"path": "/data/llama", "type": "Directory"}}),
    ("file:///data/smollm2.gguf", "/mnt/models/smollm2.gguf", {"hostPath": {"path": "/data/smollm2.gguf", "type": "File"}}),
    ("hf://meta/llama-3", "/mnt/models", {"emptyDir": {}}),
])
def test_model_volume_per_scheme(uri, path, volume):
    deployment = _children({"model": {"uri": uri}}).deployment
    pod = deployment["spec"]["template"]["spec"]
    assert _engine(deployment)["args"][1] == path
    model_volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert {k: v for k, v in model_volume.items() if k != "name"} == volume
    mount = next(m for m in _engine(deployment)["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True and path.startswith(mount["mountPath"])


def test_hf_model_is_downloaded_by_an_init_container_with_the_token():
    deployment = _children({"model": {"uri": "hf://meta/llama-3", "revision": "v2",
                                      "tokenSecret": {"name": "hf-token", "key": "t"}}}).deployment
    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["hf"]
    assert init["args"] == ["download", "meta/llama-3", "--local-dir", "/mnt/models", "--revision", "v2"]
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "t"}
    assert init["image"] == _engine(deployment)["image"]


def test_scheduling_constraints_pass_through():
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
    pod = _children({"model": {"uri": "pvc://m"}, "nodeSelector": {"pool": "gpu"}, "tolerations": tolerations,
                     "affinity": affinity}).deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == tolerations and pod["affinity"] == affinity


def test_recommended_labels_and_selector():
    children = _children({"model": {"uri": "pvc://m"}, "replicas": 3})
    for manifest in (children.deployment, children.service, children.configmap, children.pdb):
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvpilot"
        assert labels["app.kubernetes.io/instance"] == "llama"
        assert labels["app.kubernetes.io/component"] == "engine"
        assert labels["app.kubernetes.io/part-of"] == "kvpilot"
        assert labels["app.kubernetes.io/managed-by"] == "kvpilot-operator"
        assert manifest["metadata"]["namespace"] == "ml"
    selector = children.deployment["spec"]["selector"]["matchLabels"]
    template_labels = children.deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert children.service["spec"]["selector"] == selector == children.pdb["spec"]["selector"]["matchLabels"]
    assert builders.selector_string("llama") == \
        "app.kubernetes.io/component=engine,app.kubernetes.io/instance=llama,app.kubernetes.io/name=kvpilot"


def test_service_exposes_port_8000_named_http():
    service = _children({"model": {"uri": "pvc://m"}}).service
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_pdb_only_with_more_than_one_replica():
    assert _children({"model": {"uri": "pvc://m"}, "replicas": 1}).pdb is None
    pdb = _children({"model": {"uri": "pvc://m"}, "replicas": 2}).pdb
    assert pdb["spec"]["maxUnavailable"] == 1


def test_tuned_memory_fraction_rolls_pods_but_tuned_max_num_seqs_does_not():
    spec_dict = {"model": {"uri": "pvc://m"}, "tuning": {"slo": {"itlP99Seconds": 0.1}}}
    parsed = spec.parse_spec(spec_dict)
    seed = spec.EngineSettings.of(parsed.engine)
    base = _children(spec_dict, state=seed)
    more_seqs = _children(spec_dict, state=seed.replace(max_num_seqs=128))
    more_memory = _children(spec_dict, state=seed.replace(gpu_memory_utilization=0.93))
    assert more_seqs.deployment == base.deployment
    assert more_seqs.configmap != base.configmap
    assert _flag(_engine(more_memory.deployment)["args"], "--gpu-memory-utilization") == "0.93"


def test_admin_secret_holds_the_token_and_rejects_weak_ones():
    secret = builders.build_admin_secret("llama", "ml", "x" * 43)
    assert secret["metadata"]["name"] == "llama-admin" and secret["stringData"] == {"token": "x" * 43}
    # As the API server returns it: base64 under data.
    assert builders.admin_token({"data": {"token": base64.b64encode(b"x" * 43).decode()}}) == "x" * 43
    assert builders.admin_token(None) is None and builders.admin_token({"data": {}}) is None
    with pytest.raises(ValueError):
        builders.build_admin_secret("llama", "ml", "short")


FULL_SPEC = yaml.safe_load((crd.REPO_ROOT / "examples" / "full.yaml").read_text())["spec"]  # every field set
_RENDER = """
import dataclasses, json, sys
from kvpilot.operator import builders, spec, tuning_configmap
from kvpilot.operator.settings import OperatorSettings
parsed = spec.parse_spec(json.load(sys.stdin))
children = builders.build_children("llama", "ml", parsed, tuning_configmap.settings_in_effect(parsed, None),
                                   OperatorSettings(engine_image=sys.argv[1]))
print(json.dumps(dataclasses.asdict(children)))
"""


def _render_in_a_new_process(spec_dict: dict, hash_seed: int) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    result = subprocess.run([sys.executable, "-c", _RENDER, SETTINGS.engine_image], input=json.dumps(spec_dict),
                            env=env, capture_output=True, text=True, timeout=120, check=True)
    return result.stdout.strip()


def _reversed_mappings(value):
    """``value`` with the keys of every mapping in it in the opposite order."""
    if isinstance(value, dict):
        return {k: _reversed_mappings(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed_mappings(v) for v in value]
    return value


def test_builders_are_deterministic():
    """The same spec renders the same bytes in every process (sets and hashes of str differ between
    processes with PYTHONHASHSEED), and the same manifests whatever order its keys were written in."""
    renders = {_render_in_a_new_process(FULL_SPEC, seed) for seed in range(1, 5)}
    here = json.dumps(dataclasses.asdict(_children(FULL_SPEC)))
    assert renders == {here}, "the manifests differ between processes"
    assert _children(_reversed_mappings(FULL_SPEC)) == _children(FULL_SPEC)


def test_engine_pods_get_no_api_token():
    pod = _children({"model": {"uri": "pvc://m"}}).deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False


def test_tool_call_parser_and_chat_template_reach_the_engine():
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    container = _engine(_children({"model": {"uri": "pvc://models/llama"},
                                   "engine": {"toolCallParser": "hermes", "chatTemplate": template}}).deployment)
    assert _flag(container["args"], "--tool-call-parser") == "hermes"
    assert {"name": "KVPILOT_CHAT_TEMPLATE", "value": template} in container["env"]
    plain = _engine(_children({"model": {"uri": "pvc://models/llama"}}).deployment)
    assert "--tool-call-parser" not in plain["args"]
    assert all(env["name"] != "KVPILOT_CHAT_TEMPLATE" for env in plain["env"])


def test_max_waiting_seconds_reaches_the_engine_only_when_set():
    container = _engine(_children({"model": {"uri": "pvc://models/llama"},
                                   "engine": {"maxWaitingSeconds": 8}}).deployment)
    assert float(_flag(container["args"], "--max-waiting-seconds")) == 8.0
    plain = _engine(_children({"model": {"uri": "pvc://models/llama"}}).deployment)
    assert "--max-waiting-seconds" not in plain["args"]


def test_a_memory_limit_reaches_the_engine_so_the_memory_fraction_sizes_a_cpus_kv_cache():
    container = _engine(_children({"model": {"uri": "pvc://models/llama"},
                                   "resources": {"gpus": 0, "memory": "8Gi"}}).deployment)
    assert {"name": "KVPILOT_CPU_MEMORY_LIMIT", "valueFrom": {"resourceFieldRef": {
        "containerName": "engine", "resource": "limits.memory"}}} in container["env"]
    assert container["resources"]["limits"]["memory"] == "8Gi"
    unlimited = _engine(_children({"model": {"uri": "pvc://models/llama"}}).deployment)
    assert all(env["name"] != "KVPILOT_CPU_MEMORY_LIMIT" for env in unlimited["env"])


def test_lora_adapters_mount_once_per_claim_or_directory_and_reach_the_engine_through_the_tuning_file():
    children = _children({
        "model": {"uri": "pvc://models/llama-3-8b"},
        "engine": {"maxLoras": 2, "maxLoraRank": 32},
        "loras": [{"name": "sql", "uri": "pvc://adapters/llama/sql"},
                  {"name": "chat", "uri": "pvc://adapters/llama/chat"},
                  {"name": "local", "uri": "file:///srv/adapters/local"},
                  {"name": "hub", "uri": "hf://org/hub-lora", "revision": "v2"}],
    })
    pod = children.deployment["spec"]["template"]["spec"]
    args = _engine(children.deployment)["args"]
    assert "--enable-lora" in args and _flag(args, "--max-loras") == "2" and _flag(args, "--max-lora-rank") == "32"
    lora_volumes = [v for v in pod["volumes"] if v["name"].startswith("lora-")]
    assert sorted(next(iter(k for k in v if k != "name")) for v in lora_volumes) == [
        "emptyDir", "hostPath", "persistentVolumeClaim"]  # both adapters on the claim share its volume
    (claim,) = [v for v in lora_volumes if "persistentVolumeClaim" in v]
    assert claim["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    (directory,) = [v for v in lora_volumes if "hostPath" in v]
    assert directory["hostPath"] == {"path": "/srv/adapters", "type": "Directory"}
    (download,) = pod["initContainers"]
    assert download["args"] == ["download", "org/hub-lora", "--local-dir", download["volumeMounts"][0]["mountPath"],
                                "--revision", "v2"]
    mounts = {m["name"]: m["mountPath"] for m in _engine(children.deployment)["volumeMounts"]}
    modules = json.loads(children.configmap["data"]["tuning.json"])["loraModules"]
    paths = {m["name"]: m["path"] for m in modules}
    assert paths["sql"] == f"{mounts[claim['name']]}/llama/sql" and paths["chat"] == f"{mounts[claim['name']]}/llama/chat"
    assert paths["local"] == f"{mounts[directory['name']]}/local"
    assert paths["hub"] == mounts[download["volumeMounts"][0]["name"]]


def test_an_adapter_beside_mounted_ones_changes_the_tuning_file_and_not_the_pod_template():
    base = {"model": {"uri": "pvc://models/llama"}, "loras": [{"name": "sql", "uri": "pvc://adapters/sql"},
                                                               {"name": "a", "uri": "file:///srv/adapters/a"}]}
    more = {**base, "loras": [*base["loras"], {"name": "chat", "uri": "pvc://adapters/chat"},
                              {"name": "b", "uri": "file:///srv/adapters/b"}]}
    before, after = _children(base), _children(more)
    assert before.deployment == after.deployment
    assert before.configmap != after.configmap
    elsewhere = _children({**base, "loras": [*base["loras"], {"name": "c", "uri": "file:///opt/other/c"}]})
    assert elsewhere.deployment != before.deployment  # a new directory is a new volume: the pods roll
    without = _children({"model": {"uri": "pvc://models/llama"}})
    assert "--enable-lora" not in _engine(without.deployment)["args"]
    assert "loraModules" not in json.loads(without.configmap["data"]["tuning.json"])
