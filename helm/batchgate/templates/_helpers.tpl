{{/* vim: set filetype=mustache: */}}

{{- define "batchgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name, cut so that "<fullname>-engine-headless" still fits in 63 characters. */}}
{{- define "batchgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 46 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "batchgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batchgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "batchgate.labels" -}}
helm.sh/chart: {{ include "batchgate.chart" . }}
{{ include "batchgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: batchgate
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component: (dict "ctx" $ "component" "gateway") */}}
{{- define "batchgate.componentLabels" -}}
{{ include "batchgate.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "batchgate.componentSelectorLabels" -}}
{{ include "batchgate.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "batchgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "batchgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "batchgate.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "batchgate.secretName" -}}
{{- include "batchgate.fullname" . }}
{{- end }}

{{- define "batchgate.configMapName" -}}
{{- printf "%s-plans" (include "batchgate.fullname" .) }}
{{- end }}

{{- define "batchgate.redisName" -}}
{{- printf "%s-redis" (include "batchgate.fullname" .) }}
{{- end }}

{{/*
Value of a key in the chart's own Secret as it exists in the cluster (install/upgrade), so that
generated values survive upgrades; "" under `helm template` or on first install.
(dict "ctx" $ "key" "internal-token")
*/}}
{{- define "batchgate.existingSecretValue" -}}
{{- $secret := lookup "v1" "Secret" .ctx.Release.Namespace (include "batchgate.secretName" .ctx) }}
{{- if and $secret $secret.data (hasKey $secret.data .key) }}
{{- index $secret.data .key | b64dec }}
{{- end }}
{{- end }}

{{/* Where each secret value comes from: the chart's Secret or one the user names. */}}
{{- define "batchgate.internalTokenSecret" -}}
{{- default (include "batchgate.secretName" .) .Values.internalToken.existingSecret }}
{{- end }}
{{- define "batchgate.internalTokenKey" -}}
{{- ternary .Values.internalToken.existingSecretKey "internal-token" (not (empty .Values.internalToken.existingSecret)) }}
{{- end }}

{{- define "batchgate.tenantsSecret" -}}
{{- default (include "batchgate.secretName" .) .Values.tenancy.existingSecret }}
{{- end }}
{{- define "batchgate.tenantsKey" -}}
{{- ternary .Values.tenancy.existingSecretKey "tenants.toml" (not (empty .Values.tenancy.existingSecret)) }}
{{- end }}

{{/* "true" when the gateways get a Redis URL at all (else they keep limits in memory, per pod). */}}
{{- define "batchgate.redisConfigured" -}}
{{- if or .Values.redis.enabled .Values.redis.externalUrl .Values.redis.existingSecret }}true{{ end }}
{{- end }}

{{- define "batchgate.redisUrlSecret" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.existingSecret }}
{{- .Values.redis.existingSecret }}
{{- else }}
{{- include "batchgate.secretName" . }}
{{- end }}
{{- end }}
{{- define "batchgate.redisUrlKey" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.existingSecret }}
{{- .Values.redis.existingSecretKey }}
{{- else }}redis-url{{ end }}
{{- end }}

{{/* Does the chart render its own Secret? (some value is not supplied by an existing Secret) */}}
{{- define "batchgate.ownSecret" -}}
{{- if or (not .Values.internalToken.existingSecret) (and .Values.tenancy.enabled (not .Values.tenancy.existingSecret)) (and .Values.tenancy.enabled .Values.tenancy.adminKeyHash.value (not .Values.tenancy.adminKeyHash.existingSecret)) .Values.redis.enabled (and .Values.redis.externalUrl (not .Values.redis.existingSecret)) }}true{{ end }}
{{- end }}

{{/* Default upstream list for the gateways: the engine Service, then each models entry's. */}}
{{- define "batchgate.upstreams" -}}
{{- if .Values.gateway.upstreams }}
{{- join "," .Values.gateway.upstreams }}
{{- else }}
{{- $svc := printf "%s-engine" (include "batchgate.fullname" .) }}
{{- if eq .Values.gateway.upstreamService "headless" }}
{{- $svc = printf "%s-engine-headless" (include "batchgate.fullname" .) }}
{{- end }}
{{- $urls := list (printf "http://%s.%s.svc:%d" $svc .Release.Namespace (int .Values.engine.service.port)) }}
{{- range .Values.models }}
{{- $urls = append $urls (include "batchgate.modelUrl" (dict "ctx" $ "name" .name)) }}
{{- end }}
{{- join "," $urls }}
{{- end }}
{{- end }}

{{/* URL of a models entry's Service (headless when the gateways route per pod): (dict "ctx" $ "name" "llama") */}}
{{- define "batchgate.modelUrl" -}}
{{- printf "http://%s-engine-%s.%s.svc:%d" (include "batchgate.fullname" .ctx) .name .ctx.Release.Namespace (int .ctx.Values.engine.service.port) }}
{{- end }}

{{/* Long-prompt upstreams for the gateways: gateway.longPromptUpstreams, else the engineLong
Service when engineLong is enabled, else none (""). */}}
{{- define "batchgate.longPromptUpstreams" -}}
{{- if .Values.gateway.longPromptUpstreams }}
{{- join "," .Values.gateway.longPromptUpstreams }}
{{- else if .Values.engineLong.enabled }}
{{- printf "http://%s-engine-long.%s.svc:%d" (include "batchgate.fullname" .) .Release.Namespace (int .Values.engine.service.port) }}
{{- end }}
{{- end }}

{{/*
engineLong's settings over a copy of engine's: (dict "ctx" $ "e" (deepCopy .Values.engine)); sets
keys of "e" in place and renders nothing. Settings left null or empty keep engine's.
*/}}
{{- define "batchgate.engineLongValues" -}}
{{- $l := .ctx.Values.engineLong }}
{{- $e := .e }}
{{- $_ := set $e "replicaCount" $l.replicaCount }}
{{- $_ := set $e "autoscaling" (dict "enabled" false) }}
{{- $_ := set $e "keda" (dict "enabled" false) }}
{{- $_ := set $e "podDisruptionBudget" (dict "enabled" false) }}
{{- range $k := list "maxNumSeqs" "maxNumBatchedTokens" "maxModelLen" "kvCacheMemory" "targetItlMs" }}
{{- if not (kindIs "invalid" (index $l $k)) }}
{{- $_ := set $e $k (index $l $k) }}
{{- end }}
{{- end }}
{{- range $k := list "resources" "extraArgs" "nodeSelector" "tolerations" "affinity" }}
{{- if index $l $k }}
{{- $_ := set $e $k (index $l $k) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A models entry's settings over a copy of engine's: (dict "e" (deepCopy .Values.engine) "m" $entry);
sets keys of "e" in place and renders nothing. A setting the entry gives (not null) replaces
engine's, except model, embeddings, autoscaling, podDisruptionBudget and shm, whose keys are set
one by one over engine's (so that e.g. {model: {path: ...}} keeps engine's model volume). The
replicas serve chat under the entry's servedModelName (default: its name), and KEDA stays engine's.
*/}}
{{- define "batchgate.modelValues" -}}
{{- $e := .e }}
{{- $m := .m }}
{{- $_ := set $e "chat" true }}
{{- $_ := set $e "keda" (dict "enabled" false) }}
{{- range $k, $v := omit $m "name" "servedModelName" }}
{{- if not (kindIs "invalid" $v) }}
{{- if has $k (list "model" "embeddings" "autoscaling" "podDisruptionBudget" "shm") }}
{{- $into := index $e $k }}
{{- range $sk, $sv := $v }}
{{- if not (kindIs "invalid" $sv) }}
{{- $_ := set $into $sk $sv }}
{{- end }}
{{- end }}
{{- else }}
{{- $_ := set $e $k $v }}
{{- end }}
{{- end }}
{{- end }}
{{- $_ := set $e.model "servedName" (default $m.name $m.servedModelName) }}
{{- end }}

{{/*
Every engine Deployment the chart renders, in order: engine, engineLong when enabled, then one per
models entry. (dict "ctx" $ "out" (dict)) sets out.sets to a list of (dict "component" <label and
name suffix> "e" <the set's values> "what" <its values path, for messages>); renders nothing.
*/}}
{{- define "batchgate.engineSets" -}}
{{- $ctx := .ctx }}
{{- $sets := list (dict "component" "engine" "e" $ctx.Values.engine "what" "engine") }}
{{- if $ctx.Values.engineLong.enabled }}
{{- $long := deepCopy $ctx.Values.engine }}
{{- include "batchgate.engineLongValues" (dict "ctx" $ctx "e" $long) }}
{{- $sets = append $sets (dict "component" "engine-long" "e" $long "what" "engineLong") }}
{{- end }}
{{- range $i, $m := $ctx.Values.models }}
{{- $e := deepCopy $ctx.Values.engine }}
{{- include "batchgate.modelValues" (dict "e" $e "m" $m) }}
{{- $sets = append $sets (dict "component" (printf "engine-%s" $m.name) "e" $e "what" (printf "models[%d]" $i)) }}
{{- end }}
{{- $_ := set .out "sets" $sets }}
{{- end }}

{{/*
The single Service of an engine set other than engine (engineLong's, a models entry's): ClusterIP,
or headless when the gateways route per engine pod. (dict "ctx" $ "component" "engine-long")
*/}}
{{- define "batchgate.engineSetService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "batchgate.fullname" .ctx }}-{{ .component }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "batchgate.componentLabels" (dict "ctx" .ctx "component" .component) | nindent 4 }}
spec:
  {{- if eq .ctx.Values.gateway.upstreamService "headless" }}
  clusterIP: None
  publishNotReadyAddresses: false
  {{- else }}
  type: ClusterIP
  {{- end }}
  selector:
    {{- include "batchgate.componentSelectorLabels" (dict "ctx" .ctx "component" .component) | nindent 4 }}
  ports:
    - name: http
      port: {{ .ctx.Values.engine.service.port }}
      targetPort: http
      protocol: TCP
      appProtocol: http
{{- end }}

{{/* The component labels the ServiceMonitor scrapes. */}}
{{- define "batchgate.monitoredComponents" -}}
{{- $components := list "gateway" "engine" "engine-long" }}
{{- range .Values.models }}
{{- $components = append $components (printf "engine-%s" .name) }}
{{- end }}
{{- join ", " $components }}
{{- end }}

{{/*
A TOML table group from a map of maps: (dict "root" "plans" "tables" .Values.tenancy.plans).
Written by hand rather than with toToml: Helm reads every YAML number as a float, which toToml
would print as 200000.0; toJson prints whole numbers as integers, and its strings, booleans and
arrays of those are valid TOML as they are.
*/}}
{{- define "batchgate.tomlTables" -}}
{{- $root := .root }}
{{- range $name, $table := .tables }}
{{- $header := ternary $name (toJson $name) (regexMatch "^[A-Za-z0-9_-]+$" $name) }}
[{{ $root }}.{{ $header }}]
{{- range $k, $v := $table }}
{{ ternary $k (toJson $k) (regexMatch "^[A-Za-z0-9_-]+$" $k) }} = {{ toJson $v }}
{{- end }}
{{ end }}
{{- end }}

{{/* Environment shared by the gateway and the engine: (dict "ctx" $ "component" "gateway") */}}
{{- define "batchgate.commonEnv" -}}
{{- $ctx := .ctx -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: HOME
  value: {{ $ctx.Values.cache.homeDir | quote }}
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
- name: BATCHGATE_LOG_LEVEL
  value: {{ $ctx.Values.logLevel | quote }}
- name: BATCHGATE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "batchgate.internalTokenSecret" $ctx }}
      key: {{ include "batchgate.internalTokenKey" $ctx }}
{{- with $ctx.Values.otel }}
{{- if .enabled }}
- name: OTEL_SERVICE_NAME
  value: {{ default (printf "%s-%s" (include "batchgate.fullname" $ctx) $.component) .serviceName | quote }}
{{- with .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .protocol | quote }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
# Metrics are scraped from /metrics (Prometheus); logs go to stdout.
- name: OTEL_METRICS_EXPORTER
  value: none
- name: OTEL_LOGS_EXPORTER
  value: none
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
{{- $attrs := list "k8s.pod.name=$(POD_NAME)" "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.node.name=$(NODE_NAME)" (printf "service.namespace=%s" $ctx.Release.Namespace) (printf "batchgate.component=%s" $.component) }}
{{- range $k, $v := .resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%v" $k $v) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
- name: OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT
  value: {{ .captureMessageContent | quote }}
{{- with .extraEnv }}
{{ toYaml . }}
{{- end }}
{{- else }}
- name: OTEL_SDK_DISABLED
  value: "true"
{{- end }}
{{- end }}
{{- end }}

{{- define "batchgate.cacheVolumes" -}}
- name: home
  emptyDir:
    {{- with .Values.cache.medium }}
    medium: {{ . }}
    {{- end }}
    {{- with .Values.cache.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
- name: tmp
  emptyDir:
    {{- with .Values.cache.tmpSizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}

{{- define "batchgate.cacheVolumeMounts" -}}
- name: home
  mountPath: {{ .Values.cache.homeDir }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* PodDisruptionBudget spec body: (dict "pdb" .Values.gateway.podDisruptionBudget) */}}
{{- define "batchgate.pdbSpec" -}}
{{- if not (kindIs "invalid" .pdb.minAvailable) -}}
minAvailable: {{ .pdb.minAvailable }}
{{- else -}}
maxUnavailable: {{ .pdb.maxUnavailable | default 1 }}
{{- end }}
{{- end }}

{{/* HPA body: (dict "ctx" $ "component" "gateway" "values" .Values.gateway) */}}
{{- define "batchgate.hpa" -}}
{{- $a := .values.autoscaling }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "batchgate.fullname" .ctx }}-{{ .component }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "batchgate.componentLabels" (dict "ctx" .ctx "component" .component) | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "batchgate.fullname" .ctx }}-{{ .component }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  {{- if or $a.targetCPUUtilizationPercentage $a.targetMemoryUtilizationPercentage $a.metrics }}
  metrics:
    {{- with $a.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ . }}
    {{- end }}
    {{- with $a.targetMemoryUtilizationPercentage }}
    - type: Resource
      resource:
        name: memory
        target:
          type: Utilization
          averageUtilization: {{ . }}
    {{- end }}
    {{- with $a.metrics }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- with $a.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
A Deployment's terminationGracePeriodSeconds from its drain settings (the component's values):
the preStop sleep, then the server's drain timeout, then DRAIN_EXIT_MARGIN_SECONDS for it to end
the streams still open, settle, flush telemetry and exit, before Kubernetes sends SIGKILL.
*/}}
{{- define "batchgate.drainExitMarginSeconds" -}}10{{- end }}
{{- define "batchgate.terminationGracePeriodSeconds" -}}
{{- add (int64 .preStopSleepSeconds) (int64 .drainTimeoutSeconds) (include "batchgate.drainExitMarginSeconds" . | int64) }}
{{- end }}

{{/*
Bytes in a memory size, as a whole number: a Kubernetes quantity (1280Mi, 4Gi, 4G, 512M) or a
batchgate size (1GiB, 512MB, 2147483648). Binary suffixes (Ki, Mi, Gi, KiB...) count in 1024s,
decimal ones (k, M, G, KB...) in 1000s. "0" for anything else (the schema has refused it already).
*/}}
{{- define "batchgate.bytes" -}}
{{- $s := trim (toString .) -}}
{{- if (kindIs "float64" .) }}{{- $s = printf "%.0f" . }}{{- end -}}
{{- if regexMatch "^[0-9]+(\\.[0-9]+)?\\s*([KMGTPEkmgtpe][iI]?)?[bB]?$" $s -}}
{{- $number := regexReplaceAll "^([0-9.]+).*$" $s "${1}" | float64 -}}
{{- $power := regexReplaceAll "^[0-9.]+\\s*([KMGTPEkmgtpe]?).*$" $s "${1}" | upper -}}
{{- $base := ternary 1024.0 1000.0 (regexMatch "^[0-9.]+\\s*[KMGTPEkmgtpe][iI]" $s) -}}
{{- $bytes := $number -}}
{{- range $p := list "K" "M" "G" "T" "P" "E" -}}
{{- if $power -}}{{- $bytes = mulf $bytes $base -}}{{- end -}}
{{- if eq $p $power -}}{{- $power = "" -}}{{- end -}}
{{- end -}}
{{- printf "%.0f" $bytes -}}
{{- else -}}0{{- end -}}
{{- end }}

{{/* "true" when an engine set (its values: .Values.engine) runs on the CPU, so that its KV cache
is host (pod) memory. */}}
{{- define "batchgate.engineOnCpu" -}}
{{- $e := . -}}
{{- $gpu := or (hasKey (default dict $e.resources.limits) "nvidia.com/gpu") (hasKey (default dict $e.resources.requests) "nvidia.com/gpu") -}}
{{- if or (eq $e.device "cpu") (and (eq $e.device "auto") (not $gpu)) }}true{{ end -}}
{{- end }}
