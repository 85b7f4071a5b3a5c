{{/* Chart name, truncated to a DNS label. */}}
{{- define "mnn-rollout.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name when it already contains the chart name, else "<release>-<chart>". */}}
{{- define "mnn-rollout.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "mnn-rollout.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object; pass a dict {ctx, component}. */}}
{{- define "mnn-rollout.labels" -}}
{{- $ctx := .ctx -}}
helm.sh/chart: {{ include "mnn-rollout.chart" $ctx }}
{{ include "mnn-rollout.selectorLabels" . }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: mnn-rollout
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
{{- end }}

{{/* Selector labels; pass a dict {ctx, component}. */}}
{{- define "mnn-rollout.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mnn-rollout.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "mnn-rollout.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mnn-rollout.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "mnn-rollout.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{- define "mnn-rollout.peeringName" -}}
{{- default (include "mnn-rollout.fullname" .) .Values.peering.name }}
{{- end }}

{{- define "mnn-rollout.webhookSecretName" -}}
{{- default (printf "%s-webhook-token" (include "mnn-rollout.fullname" .)) .Values.webhook.existingSecret }}
{{- end }}

{{- define "mnn-rollout.webhookServiceName" -}}
{{- printf "%s-webhook" (include "mnn-rollout.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mnn-rollout.metricsServiceName" -}}
{{- printf "%s-metrics" (include "mnn-rollout.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Where the webhook token Secret is mounted, and the file the operator reads. */}}
{{- define "mnn-rollout.webhookTokenDir" -}}/etc/mnn-rollout/webhook{{- end }}
{{- define "mnn-rollout.webhookTokenFile" -}}
{{- printf "%s/%s" (include "mnn-rollout.webhookTokenDir" .) .Values.webhook.secretKey }}
{{- end }}

{{/*
RBAC rules the operator needs in every namespace it watches. Derived from the code
(operator/rollout_operator/kube.py RESOURCES and the calls made on it) and from kopf 1.45;
tests/helm/test_rbac.py checks this list against the code and that nothing else is granted.
*/}}
{{- define "mnn-rollout.namespacedRules" -}}
# ModelDeployments: kopf lists, watches and patches them (finalizer, progress annotations);
# the reconciler gets them; the Alertmanager webhook lists and annotates (patches) them.
- apiGroups: [mnnrollout.io]
  resources: [modeldeployments]
  verbs: [get, list, watch, patch]
# The reconciler replaces (PUT) the whole status (kopf itself writes no status: the handlers
# return nothing and its progress is kept in annotations).
- apiGroups: [mnnrollout.io]
  resources: [modeldeployments/status]
  verbs: [update]
# Children carry an ownerReference with blockOwnerDeletion: true, which clusters with the
# OwnerReferencesPermissionEnforcement admission plugin allow only with update on finalizers.
- apiGroups: [mnnrollout.io]
  resources: [modeldeployments/finalizers]
  verbs: [update]
# Children: ConfigMap <name>-routing, Service, ServiceAccount: written by server-side apply
# (patch; create when the apply creates); read (get) before the watch cache is synced;
# list/watch (by the owner label) so that a child edited or deleted by hand wakes its owner,
# whose reconcile puts it back. (The runtime's Role grants get/watch on its ConfigMap, and
# RBAC lets a subject grant only permissions it holds itself.)
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [get, list, watch, create, patch]
# Children: Deployment <name>-runtime.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
# Children: PodDisruptionBudget <name>-runtime.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
# Children: HorizontalPodAutoscaler <name>-runtime (spec.runtime.autoscaling); deleted by the
# operator when autoscaling is removed from the spec (the only child it deletes itself).
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
# Children: the runtime's Role and RoleBinding.
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch]
# Runtime pods are listed (by label) to find the ready ones and scrape their /metrics, and
# watched (by label) so that a pod becoming ready or going away wakes its ModelDeployment.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# spec.strategy.analysis.provider.secretRef: the Prometheus Authorization header, read by name.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
# kopf posts Events (core/v1) about the rollout and its own errors.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
