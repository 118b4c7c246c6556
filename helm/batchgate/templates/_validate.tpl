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
{{- range $c := list "gateway" "engine" }}
{{- $a := (index $.Values $c).autoscaling }}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $c (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}
