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
{{- include "batchgate.validateEngineMemory" (dict "e" .Values.engine "what" "engine") }}
{{- range $c := list "gateway" "engine" }}
{{- $a := (index $.Values $c).autoscaling }}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $c (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- end }}
{{- $g := .Values.gateway }}
{{- if and $g.storage.persistence.enabled (or $g.autoscaling.enabled (gt (int $g.replicaCount) 1)) }}
{{- fail "gateway.storage.persistence is one ReadWriteOnce volume: it serves one gateway pod (gateway.replicaCount=1, gateway.autoscaling.enabled=false); several gateways share the Batch API through Redis and gateway.storage.filesBucket, with persistence off" }}
{{- end }}
{{- include "batchgate.validateModels" . }}
{{- end }}

{{/*
The models entries: names that make distinct, valid object names and distinct served model names;
each set (engine's settings with the entry's over them) checked as engine is.
*/}}
{{- define "batchgate.validateModels" -}}
{{- $fullname := include "batchgate.fullname" . }}
{{- $names := dict }}
{{- $served := dict }}
{{- with .Values.engine.model.servedName }}
{{- $_ := set $served . "engine.model.servedName" }}
{{- end }}
{{- range $i, $m := .Values.models }}
{{- $what := printf "models[%d]" $i }}
{{- if hasKey $names $m.name }}
{{- fail (printf "%s.name %q is also %s's: each models entry needs its own name (its Deployment and Service are %s-engine-<name>)" $what $m.name (index $names $m.name) $fullname) }}
{{- end }}
{{- $_ := set $names $m.name $what }}
{{- $object := printf "%s-engine-%s" $fullname $m.name }}
{{- if gt (len $object) 63 }}
{{- fail (printf "%s.name %q makes the object name %q, over 63 characters: shorten the name (or fullnameOverride)" $what $m.name $object) }}
{{- end }}
{{- $s := default $m.name $m.servedModelName }}
{{- if hasKey $served $s }}
{{- fail (printf "%s serves %q, as %s does already: one replica set per model (replicaCount sets how many replicas)" $what $s (index $served $s)) }}
{{- end }}
{{- $_ := set $served $s $what }}
{{- end }}
{{- $out := dict }}
{{- include "batchgate.engineSets" (dict "ctx" . "out" $out) }}
{{- range $set := $out.sets }}
{{- if hasPrefix "models[" $set.what }}
{{- $e := $set.e }}
{{- if lt (int $.Values.gateway.drainTimeoutSeconds) (int $e.drainTimeoutSeconds) }}
{{- fail (printf "gateway.drainTimeoutSeconds (%d) is below %s.drainTimeoutSeconds (%d): a draining gateway would cut streams that its engines still finish" (int $.Values.gateway.drainTimeoutSeconds) $set.what (int $e.drainTimeoutSeconds)) }}
{{- end }}
{{- if and $e.autoscaling.enabled (gt (int $e.autoscaling.minReplicas) (int $e.autoscaling.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $set.what (int $e.autoscaling.minReplicas) (int $e.autoscaling.maxReplicas)) }}
{{- end }}
{{- include "batchgate.validateEngineMemory" (dict "e" $e "what" $set.what) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A CPU engine's KV cache is pod memory that the engine fills and keeps full: the memory request
(what the scheduler reserves) and the limit must hold it plus what the process needs besides.
*/}}
{{- define "batchgate.validateEngineMemory" -}}
{{- $e := .e }}
{{- $w := .what }}
{{- if include "batchgate.engineOnCpu" $e }}
{{- $requests := default dict $e.resources.requests }}
{{- $limits := default dict $e.resources.limits }}
{{- if kindIs "invalid" $e.kvCacheMemory }}
{{- if not $limits.memory }}
{{- fail (printf "%s.kvCacheMemory is null and %s.resources.limits.memory is not set: the KV cache would take 30%% of the node's free memory; set %s.kvCacheMemory (and memory requests and limits that hold it) or a memory limit" $w $w $w) }}
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
{{- fail (printf "%s.resources.%s.memory (%v) is below %s.kvCacheMemory (%v) + %s.memoryBesidesKvCache (%v) = %dMi: a CPU engine's KV cache is pod memory, filled and kept full (prefix caching)" $w $what (default "unset" $set.memory) $w $e.kvCacheMemory $w $e.memoryBesidesKvCache $needMi) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
