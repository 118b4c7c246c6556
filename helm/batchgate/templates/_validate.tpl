{{/*
Checks across values that the schema cannot express clearly; included by gateway-deployment.yaml so
that `helm lint`, `helm template` and `helm install` all stop with a readable message.
*/}}
{{- define "batchgate.validate" -}}
{{- if and .Values.tenancy.enabled (not .Values.tenancy.tenants) (not .Values.tenancy.existingSecret) }}
{{- fail "tenancy.enabled=true needs tenancy.tenants (each with plan and sha256 key hashes) or tenancy.existingSecret; set tenancy.enabled=false for open mode" }}
{{- end }}
{{- if and .Values.redis.enabled (or .Values.redis.externalUrl .Values.redis.existingSecret) }}
{{- fail "redis.enabled=true runs Redis in the release: leave redis.externalUrl and redis.existingSecret empty, or set redis.enabled=false to use an external Redis" }}
{{- end }}
{{- if and .Values.redis.externalUrl .Values.redis.existingSecret }}
{{- fail "set either redis.externalUrl or redis.existingSecret, not both" }}
{{- end }}
{{- if .Values.tenancy.enabled }}
{{- range $name, $t := .Values.tenancy.tenants }}
{{- if not (hasKey $.Values.tenancy.plans $t.plan) }}
{{- fail (printf "tenancy.tenants.%s.plan is %q, which is not one of tenancy.plans (%s)" $name $t.plan (keys $.Values.tenancy.plans | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (not .Values.engine.chat) (eq .Values.engine.embeddings.model "none") }}
{{- fail "engine.chat=false and engine.embeddings.model=none leave the engine nothing to serve" }}
{{- end }}
{{- if lt (int .Values.gateway.drainTimeoutSeconds) (int .Values.engine.drainTimeoutSeconds) }}
{{- fail (printf "gateway.drainTimeoutSeconds (%d) is below engine.drainTimeoutSeconds (%d): a draining gateway would cut streams that its engines still finish" (int .Values.gateway.drainTimeoutSeconds) (int .Values.engine.drainTimeoutSeconds)) }}
{{- end }}
{{- include "batchgate.validateEngineMemory" . }}
{{- range $c := list "gateway" "engine" }}
{{- $a := (index $.Values $c).autoscaling }}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $c (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A CPU engine's KV cache is pod memory that the engine fills and keeps full: the memory request
(what the scheduler reserves) and the limit must hold it plus what the process needs besides.
*/}}
{{- define "batchgate.validateEngineMemory" -}}
{{- $e := .Values.engine }}
{{- if include "batchgate.engineOnCpu" . }}
{{- $requests := default dict $e.resources.requests }}
{{- $limits := default dict $e.resources.limits }}
{{- if kindIs "invalid" $e.kvCacheMemory }}
{{- if not $limits.memory }}
{{- fail "engine.kvCacheMemory is null and engine.resources.limits.memory is not set: the KV cache would take 30% of the node's free memory; set engine.kvCacheMemory (and memory requests and limits that hold it) or a memory limit" }}
{{- end }}
{{- else }}
{{- $kv := include "batchgate.bytes" $e.kvCacheMemory | float64 }}
{{- $besides := include "batchgate.bytes" $e.memoryBesidesKvCache | float64 }}
{{- $need := addf $kv $besides }}
{{- $needMi := divf $need 1048576.0 | ceil | int64 }}
{{- range $what, $set := dict "requests" $requests "limits" $limits }}
{{- if or $set.memory (eq $what "requests") }}
{{- $have := include "batchgate.bytes" (default "0" $set.memory) | float64 }}
{{- if lt $have $need }}
{{- fail (printf "engine.resources.%s.memory (%v) is below engine.kvCacheMemory (%v) + engine.memoryBesidesKvCache (%v) = %dMi: a CPU engine's KV cache is pod memory, filled and kept full (prefix caching)" $what (default "unset" $set.memory) $e.kvCacheMemory $e.memoryBesidesKvCache $needMi) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
