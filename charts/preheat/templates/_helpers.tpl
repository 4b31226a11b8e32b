{{- define "preheat.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "preheat.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "preheat.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "preheat.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "preheat.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces served: the list given, else the release namespace. */}}
{{- define "preheat.namespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- join "," .Values.watch.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* Several replicas elect one active operator through kopf peering; one runs standalone. */}}
{{- define "preheat.peering" -}}
{{- if gt (int .Values.operator.replicas) 1 -}}true{{- end -}}
{{- end -}}

{{/* What the operator does with the API: keep in step with operator/ (tests/helm checks). */}}
{{- define "preheat.operatorRules" -}}
- apiGroups: [serving.preheat.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.preheat.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion: true; with the admission plugin
# OwnerReferencesPermissionEnforcement (OpenShift's default) that needs update here.
- apiGroups: [serving.preheat.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
# The built-in autoscaler (metric.type Engine) sets replicas where an HPA would: /scale.
- apiGroups: [serving.preheat.dev]
  resources: [inferenceservices/scale]
  verbs: [patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get]
# Create only: the per-service peer secret (a 409 means it exists). No get, list or
# watch: the operator never reads a Secret; a missing one shows in the pods' status.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if include "preheat.peering" . }}
# kopf's peering: watch the peering object, patch our own keep-alive into its status.
- apiGroups: [kopf.dev]
  resources: [{{ if .Values.watch.allNamespaces }}clusterkopfpeerings{{ else }}kopfpeerings{{ end }}]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}
