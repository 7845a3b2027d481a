#!/usr/bin/env bash
# The kvpilot demo, end to end on this machine, no Docker and no GPU needed:
#   1. sets up everything (scripts/setup.sh: virtualenv, control-plane binaries);
#   2. generates a small random Llama-family model (`kvpilot make-model`);
#   3. starts a real local Kubernetes control plane with two fake GPU nodes
#      (`kvpilot local-cluster up`; pods run as local processes);
#   4. installs the operator with Helm (charts/kvpilot), so it runs as a pod;
#   5. applies an InferenceService and waits until its engine pod is Ready;
#   6. sends an OpenAI completion to the engine and shows `kubectl get kvis`.
# The cluster stays up afterwards so you can explore; the last lines say how
# to stop it (`kvpilot local-cluster down`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

MODEL_DIR="$KVPILOT_CACHE/models/demo-tiny-llama"
step "Generating a tiny random Llama model in $MODEL_DIR"
if [[ ! -f "$MODEL_DIR/config.json" ]]; then
    kvpilot make-model "$MODEL_DIR" --preset tiny --arch llama --seed 0
else
    echo "already there"
fi

step "Starting the local control plane"
kvpilot local-cluster up
KUBECONFIG="$(kvpilot local-cluster kubeconfig)"
export KUBECONFIG
kubectl get nodes -o custom-columns='NODE:.metadata.name,STATUS:.status.conditions[-1].type,GPUS:.status.capacity.nvidia\.com/gpu'

step "Installing the operator with Helm"
helm upgrade --install kvpilot charts/kvpilot --namespace kvpilot-system --create-namespace \
    --set engine.bindPodIP=true --set tuning.intervalSeconds=15 --wait --timeout 5m
kubectl -n kvpilot-system get pods

step "Applying an InferenceService"
kubectl apply -f - <<YAML
apiVersion: kvpilot.io/v1alpha1
kind: InferenceService
metadata:
  name: demo
  namespace: default
spec:
  model:
    uri: file://$MODEL_DIR
    servedName: demo
  resources:
    gpus: 1
  engine:
    maxNumSeqs: 16
    maxModelLen: 512
    extraArgs: ["--device", "cpu", "--kv-cache-memory", "64MiB"]
YAML
kubectl wait kvis/demo --for=condition=Ready --timeout=300s
kubectl get kvis demo
kubectl get deployment,service,configmap,pods -l app.kubernetes.io/instance=demo

step "Asking the engine for a completion (OpenAI API, through the pod IP)"
POD_IP="$(kubectl get pods -l app.kubernetes.io/instance=demo -o jsonpath='{.items[0].status.podIP}')"
curl -sS "http://$POD_IP:8000/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "demo", "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}'
echo

cat <<TXT

The demo cluster is still running. Try:
  export KUBECONFIG=$KUBECONFIG PATH=$(kvpilot local-cluster bin-dir):$KVPILOT_VENV/bin:\$PATH
  kubectl describe kvis demo          # conditions, tuning state, events
  kubectl explain kvis.spec.tuning    # every field, documented
  curl http://$POD_IP:8000/metrics    # the engine's Prometheus metrics
Stop everything with: $KVPILOT_VENV/bin/kvpilot local-cluster down
TXT
