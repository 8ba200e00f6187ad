{{- define "ucm-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ucm-operator.labels" -}}
app.kubernetes.io/name: ucm-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ucm-operator.selector" -}}
app.kubernetes.io/name: ucm-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ucm-operator.serviceAccountName" -}}
{{- default (include "ucm-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- /* "true" when the deployments get monitors and the chart its PrometheusRule: asked for, or
"auto" and the cluster serves the Prometheus Operator's API. */ -}}
{{- define "ucm-operator.prometheusOperator" -}}
{{- $want := .Values.monitoring.prometheusOperator -}}
{{- if or (eq (toString $want) "true") (and (eq (toString $want) "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule")) -}}
true
{{- end -}}
{{- end -}}
