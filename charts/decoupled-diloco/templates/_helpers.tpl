{{/* The release's full name, shortened to a DNS label. */}}
{{- define "diloco.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "diloco.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "diloco.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "diloco.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "diloco.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces the operator watches, as a JSON list: watchNamespaces, then the older
single watchNamespace, without repeats; [] watches the whole cluster. */}}
{{- define "diloco.watchNamespaces" -}}
{{- $all := concat (.Values.watchNamespaces | default list) (ternary (list .Values.watchNamespace) list (ne .Values.watchNamespace "")) -}}
{{- $all | uniq | toJson -}}
{{- end -}}

{{/* The admission webhook's objects (templates/webhook.yaml): its Service, the Secret holding its
certificate (the operator's or cert-manager's), and the ValidatingWebhookConfiguration. */}}
{{- define "diloco.webhookService" -}}
{{- printf "%s-webhook" (include "diloco.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "diloco.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "diloco.fullname" .) -}}
{{- end -}}

{{- define "diloco.webhookConfiguration" -}}
{{- include "diloco.fullname" . -}}
{{- end -}}

{{/* Whether the operator makes the webhook's certificate (no cert-manager): then it needs its
Secret and the webhook configuration's caBundle. */}}
{{- define "diloco.webhookMakesCertificate" -}}
{{- if and .Values.webhook.enabled (not .Values.webhook.certManager.enabled) }}true{{ end -}}
{{- end -}}
