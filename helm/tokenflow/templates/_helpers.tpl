{{/* The chart name. */}}
{{- define "tokenflow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{/* The RayService's name: KubeRay allows at most 47 characters (it appends suffixes). */}}
{{- define "tokenflow.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "tokenflow.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tokenflow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Labels that select this release's Ray pods (KubeRay adds ray.io/* labels too). */}}
{{- define "tokenflow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenflow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tokenflow.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Ray Serve's config (serveConfigV2): one application running tokenflow's app builder, whose
args are the `tokenflow` values block (an AppConfig) as given.
*/}}
{{- define "tokenflow.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: {{ .Values.tokenflow.host | default "0.0.0.0" | quote }}
  port: {{ .Values.tokenflow.port | default 8000 }}
applications:
  - name: {{ .Values.appName | quote }}
    import_path: tokenflow.cluster.app:build_app
    route_prefix: {{ .Values.tokenflow.route_prefix | default "/" | quote }}
    args:
      {{- toYaml .Values.tokenflow | nindent 6 }}
{{- end -}}

{{/* Container ports every Ray pod has: Serve's HTTP proxy and the metrics export. */}}
{{- define "tokenflow.commonPorts" -}}
- name: serve
  containerPort: {{ .Values.tokenflow.port | default 8000 }}
  protocol: TCP
- name: metrics
  containerPort: {{ .Values.ports.metrics }}
  protocol: TCP
{{- end -}}

{{/* The checkpoint volume's mount (in the Ray container), when enabled. */}}
{{- define "tokenflow.volumeMounts" -}}
{{- if .Values.models.enabled -}}
volumeMounts:
  - name: models
    mountPath: {{ .Values.models.mountPath }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* The checkpoint volume (in the pod), when enabled: any Kubernetes volume source. */}}
{{- define "tokenflow.volumes" -}}
{{- if .Values.models.enabled -}}
volumes:
  - name: models
    {{- toYaml .Values.models.volume | nindent 4 }}
{{- end }}
{{- end -}}

{{/* Scheduling fields of a pod spec, from a head or worker-group values block. */}}
{{- define "tokenflow.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod metadata (labels, annotations) of a head or worker group. */}}
{{- define "tokenflow.podMetadata" -}}
metadata:
  labels:
    {{- include "tokenflow.selectorLabels" .root | nindent 4 }}
    {{- with .group.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .group.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
Ray Serve's switches for `tokenflow.serving_mode` (tokenflow/cluster/serving_mode.py): Serve
reads them from every Ray process's environment at start, so every pod gets them. The default
mode here must be AppConfig's (a chart test checks both, and each mode's variables).
*/}}
{{- define "tokenflow.servingEnv" -}}
{{- $mode := .Values.tokenflow.serving_mode | default "haproxy" -}}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" (eq $mode "haproxy") | quote }}
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: {{ ternary "1" "0" (eq $mode "haproxy") | quote }}
- name: RAY_SERVE_USE_GRPC_BY_DEFAULT
  value: {{ ternary "1" "0" (eq $mode "proxy_ingress_grpc") | quote }}
- name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
  value: "0"
- name: RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE
  value: "1000"
- name: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
  value: "2"
- name: RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S
  value: "60"
- name: RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S
  value: "30"
- name: RAY_SERVE_HAPROXY_RETRY_ON
  value: "conn-failure empty-response junk-response"
- name: RAY_SERVE_HAPROXY_RETRIES
  value: "10"
- name: RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER
  value: "2s"
- name: RAY_worker_niceness
  value: "0"
- name: RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE
  value: {{ .Values.ingressRoutersPerNode | default 1 | quote }}
{{- /* HAProxy holds each request whole before sending it on (so that it may send it again when its replica dies), and the ingress request router gets the body (to route on the prompt or the adapter). */}}
{{- if eq $mode "haproxy" }}
- name: RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY
  value: "1"
- name: RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE
  value: "262144"
{{- end }}
{{- end -}}
