{{/* Name of the chart's objects: the release name, plus "-kvpilot" unless it already says so. */}}
{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpilot.labels" -}}
{{ include "kvpilot.selectorLabels" . }}
app.kubernetes.io/part-of: kvpilot
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Namespaces the operator watches when namespaced; validated here so a typo fails at install. */}}
{{- define "kvpilot.watchNamespaces" -}}
{{- if not (has .Values.rbac.scope (list "cluster" "namespaced")) -}}
{{- fail (printf "rbac.scope must be cluster or namespaced, got %q" .Values.rbac.scope) -}}
{{- end -}}
{{- if .Values.rbac.watchNamespaces -}}
{{- join "," .Values.rbac.watchNamespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* What the operator does, and nothing more (see operator/kube.py and kopf's needs). */}}
{{- define "kvpilot.rules" -}}
- apiGroups: ["kvpilot.io"]
  resources: ["inferenceservices"]
  # watch for reconciles; patch for kopf's finalizer and progress annotations
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvpilot.io"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch"]
- apiGroups: ["kvpilot.io"]
  resources: ["inferenceservices/scale"]
  # the autoscaler sets replicas through the scale subresource, as an HPA would
  verbs: ["get", "patch", "update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  # watch keeps the status fresh; create+patch is server-side apply
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  # watch: a tuning ConfigMap the control loop changed triggers the reconcile that renders it
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  # the engines' admin token: created once, read by the tuner
  verbs: ["get", "create"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  # status diagnosis, the tuner's list of engines to scrape, and the gateway pods' held requests
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  # kopf posts Events on InferenceServices; the status reads the pods' Events
  verbs: ["create", "list"]
{{- end -}}
