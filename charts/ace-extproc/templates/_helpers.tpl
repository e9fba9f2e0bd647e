{{- define "ace-extproc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ace-extproc.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ace-extproc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ace-extproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ace-extproc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "ace-extproc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "ace-extproc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ace-extproc.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ace-extproc.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "ace-extproc.saltSecretName" -}}
{{- default (printf "%s-salt" (include "ace-extproc.fullname" .)) .Values.saltSecret.existingSecret -}}
{{- end -}}

{{/* The chart's Redis for sharing placements (shareRedis): its name (Deployment,
     Service, Secret), its pods' labels (a name of their own, so the gateway's
     selectors never pick them), the password's key, and the URL ace-extproc dials. */}}
{{- define "ace-extproc.shareRedisName" -}}
{{- printf "%s-redis" (include "ace-extproc.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ace-extproc.shareRedisSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-redis" (include "ace-extproc.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ace-extproc.shareRedisPasswordKey" -}}
ACE_SHARE_PASSWORD
{{- end -}}

{{- define "ace-extproc.shareRedisUrl" -}}
{{- printf "redis://%s.%s.svc:6379/0" (include "ace-extproc.shareRedisName" .) .Release.Namespace -}}
{{- end -}}

{{/* The namespaces whose EndpointSlices `type: kubernetes` discovery reads. */}}
{{- define "ace-extproc.discoveryNamespaces" -}}
{{- $namespaces := list -}}
{{- range .Values.destinations -}}
{{- if and .discovery (eq (toString .discovery.type) "kubernetes") -}}
{{- $namespaces = append $namespaces (toString .discovery.namespace) -}}
{{- end -}}
{{- end -}}
{{- $namespaces | uniq | sortAlpha | join "," -}}
{{- end -}}

{{/* Pods found at run time need endpoint mode (envoy_config.py refuses otherwise). */}}
{{- define "ace-extproc.checkFleet" -}}
{{- if ne .Values.mode "gateway" -}}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.grpcFrom) -}}
{{- fail (printf "mode %s opens ace-extproc's ext_proc port to the cluster with no token asked: set networkPolicy.grpcFrom to the gateway's pods (or networkPolicy.enabled: false)" .Values.mode) -}}
{{- end -}}
{{- end -}}
{{- if and (include "ace-extproc.poolMode" .) .Values.inferencePool.create (not .Values.inferencePool.selector) -}}
{{- fail "inferencePool.selector: the engine pods' labels are needed for the InferencePool" -}}
{{- end -}}
{{- if and (eq .Values.mode "extension") (not .Values.extension.targetRefs) -}}
{{- fail "extension.targetRefs: name the Gateway or HTTPRoute the EnvoyExtensionPolicy attaches to" -}}
{{- end -}}
{{- if and (eq .Values.mode "extension") .Values.extension.endpointOverride -}}
{{- range .Values.destinations -}}
{{- if not .discovery -}}
{{- fail (printf "extension.endpointOverride: destination %s needs discovery (the HTTPRoute backend Service's EndpointSlices, type: kubernetes), so that ace-extproc names its pods as Envoy Gateway knows them (or set extension.endpointOverride: false)" (toString .id)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.mode "istio") (eq .Values.istio.path "envoyFilter") (not .Values.istio.workloadSelector) -}}
{{- fail "istio.workloadSelector: the labels of the Istio ingress gateway or sidecar pods the EnvoyFilter patches" -}}
{{- end -}}
{{- if not .Values.destinations -}}
{{- fail "destinations: at least one destination is needed" -}}
{{- end -}}
{{- if and .Values.shareRedis .Values.shareRedis.enabled -}}
{{- if .Values.router.share_url -}}
{{- fail "shareRedis.enabled sets router.share_url: leave router.share_url unset (or shareRedis off to use your own Redis)" -}}
{{- end -}}
{{- if and .Values.sharePassword .Values.sharePassword.existingSecret -}}
{{- fail "shareRedis.enabled makes the Redis password: leave sharePassword.existingSecret unset" -}}
{{- end -}}
{{- end -}}
{{- with .Values.upstreamCA -}}
{{- if and .existingSecret .existingConfigMap -}}
{{- fail "upstreamCA: name existingSecret or existingConfigMap, not both" -}}
{{- end -}}
{{- if and (or .existingSecret .existingConfigMap) $.Values.router.upstream_ca_file -}}
{{- fail "upstreamCA sets router.upstream_ca_file: leave router.upstream_ca_file unset" -}}
{{- end -}}
{{- end -}}
{{- $mode := default "cluster" .Values.router.upstream_mode -}}
{{- range .Values.destinations -}}
{{- if and .discovery (ne $mode "endpoint") -}}
{{- fail (printf "destination %s: discovery needs router.upstream_mode: endpoint" (toString .id)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ace-extproc.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Where the upstream CA is mounted, when upstreamCA names one ("" otherwise). */}}
{{- define "ace-extproc.upstreamCAPath" -}}
{{- with .Values.upstreamCA -}}
{{- if or .existingSecret .existingConfigMap -}}
{{- printf "/etc/ace-ca/%s" .key -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The metrics ports of `serve --workers N`: worker i listens on ports.metrics + i
     (telemetry.worker_listen), each with its own tallies. Named metrics, metrics-1, ... */}}
{{- define "ace-extproc.metricsPorts" -}}
{{- range $i := until (int .Values.extproc.workers) }}
- {name: {{ if eq $i 0 }}metrics{{ else }}{{ printf "metrics-%d" $i }}{{ end }}, containerPort: {{ add $.Values.ports.metrics $i }}, protocol: TCP}
{{- end }}
{{- end -}}

{{/* Ports that must not clash: Envoy's listener, admin and stats listener, and
     ace-extproc's ext_proc, admin and every worker's metrics port. */}}
{{- define "ace-extproc.checkPorts" -}}
{{- $used := dict -}}
{{- $ports := list -}}
{{- if eq .Values.mode "gateway" -}}
{{- $ports = list (list "ports.http" .Values.ports.http) (list "Envoy's admin" 9901) (list "envoy.statsPort" .Values.envoy.statsPort) -}}
{{- end -}}
{{- if or (gt (int .Values.extproc.workers) 1) (ne .Values.mode "gateway") -}}
{{- $ports = append $ports (list "ports.extproc" .Values.ports.extproc) -}}
{{- end -}}
{{- if le (int .Values.extproc.workers) 1 -}}
{{- /* the admin API is off with several workers */ -}}
{{- $ports = append $ports (list "ace-extproc's admin" 9091) -}}
{{- end -}}
{{- range $i := until (int .Values.extproc.workers) -}}
{{- $ports = append $ports (list (printf "ports.metrics (worker %d)" $i) (add $.Values.ports.metrics $i)) -}}
{{- end -}}
{{- range $ports -}}
{{- $key := toString (index . 1) -}}
{{- if hasKey $used $key -}}
{{- fail (printf "port clash: %s and %s are both %s" (index $used $key) (index . 0) $key) -}}
{{- end -}}
{{- $_ := set $used $key (index . 0) -}}
{{- end -}}
{{- end -}}

{{/* The ext_proc Service as the gateway that dials it names it. */}}
{{- define "ace-extproc.grpcHost" -}}
{{- printf "%s.%s.svc.cluster.local" (include "ace-extproc.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* The Secret holding the endpoint picker's certificate, where a pool mode serves
     TLS from one ("" otherwise). */}}
{{- define "ace-extproc.eppSecret" -}}
{{- if and (include "ace-extproc.poolMode" .) .Values.endpointPicker.tls.enabled -}}
{{- .Values.endpointPicker.tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* The namespaces whose pods `type: kubernetes-pods` discovery reads (the release's
     in a pool mode, for the destinations that find the pool's pods). */}}
{{- define "ace-extproc.podsNamespaces" -}}
{{- $namespaces := list -}}
{{- range .Values.destinations -}}
{{- if and .discovery (eq (toString .discovery.type) "kubernetes-pods") -}}
{{- $namespaces = append $namespaces (toString .discovery.namespace) -}}
{{- else if and (include "ace-extproc.poolMode" $) (not .discovery) (not .pods) -}}
{{- $namespaces = append $namespaces $.Release.Namespace -}}
{{- end -}}
{{- end -}}
{{- $namespaces | uniq | sortAlpha | join "," -}}
{{- end -}}

{{/* Whether this mode makes an InferencePool ("true" or ""). */}}
{{- define "ace-extproc.poolMode" -}}
{{- if or (eq .Values.mode "endpoint-picker") (and (eq .Values.mode "istio") (eq .Values.istio.path "inferencePool")) -}}
true
{{- end -}}
{{- end -}}
