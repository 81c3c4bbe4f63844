{{/*
Names, labels and image references shared by every template.
Resource names are DNS labels: at most 63 characters, no trailing dash.
*/}}

{{- define "abada.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "abada.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<suffix>", kept within 63 characters. Call with (list $ "suffix"). */}}
{{- define "abada.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "abada.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "abada.engine.fullname" -}}{{ include "abada.componentName" (list . "engine") }}{{- end -}}
{{- define "abada.broker.fullname" -}}{{ include "abada.componentName" (list . "broker") }}{{- end -}}
{{- define "abada.migrate.fullname" -}}{{ include "abada.componentName" (list . "migrate") }}{{- end -}}

{{/*
A DNS-safe pool name from a topic: lower case, anything outside [a-z0-9-] becomes "-", runs of "-"
collapse, no dash at either end ("abada:agent" -> "abada-agent").
*/}}
{{- define "abada.dnsSafe" -}}
{{- $name := regexReplaceAll "[^a-z0-9-]+" (lower .) "-" -}}
{{- regexReplaceAll "-+" $name "-" | trimAll "-" -}}
{{- end -}}

{{/*
The settings of one worker pool: workerDefaults with the entry's own keys on top. Maps merge, except
resources, affinity and nodeSelector, which replace like lists do: a merged resources block could end
up with a default limit below the pool's own request. Returns JSON (templates can only return
strings); read it with fromJson. Call with (dict "root" $ "entry" $entry).
*/}}
{{- define "abada.worker.settings" -}}
{{- $defaults := omit (deepCopy .root.Values.workerDefaults) "serviceAccount" -}}
{{- $pool := mergeOverwrite $defaults (deepCopy .entry) -}}
{{- range $key := list "resources" "affinity" "nodeSelector" -}}
{{- if hasKey $.entry $key -}}
{{- $_ := set $pool $key (deepCopy (index $.entry $key)) -}}
{{- end -}}
{{- end -}}
{{- $poolName := include "abada.dnsSafe" (default .entry.topic .entry.name) -}}
{{- $_ := set $pool "poolName" $poolName -}}
{{- $_ := set $pool "fullname" (include "abada.componentName" (list .root (printf "worker-%s" $poolName))) -}}
{{- if kindIs "invalid" $pool.terminationGracePeriodSeconds -}}
{{- $_ := set $pool "terminationGracePeriodSeconds" (add (int $pool.drainSeconds) 30) -}}
{{- end -}}
{{- toJson $pool -}}
{{- end -}}

{{/* Every pool's settings as a JSON list, in the order of `workers`. */}}
{{- define "abada.worker.pools" -}}
{{- $pools := list -}}
{{- range .Values.workers -}}
{{- $pools = append $pools (include "abada.worker.settings" (dict "root" $ "entry" .) | fromJson) -}}
{{- end -}}
{{- toJson (dict "pools" $pools) -}}
{{- end -}}

{{- define "abada.worker.serviceAccountName" -}}
{{- if .Values.workerDefaults.serviceAccount.create -}}
{{- default (include "abada.componentName" (list . "worker")) .Values.workerDefaults.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.workerDefaults.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "abada.engine.serviceAccountName" -}}
{{- if .Values.engine.serviceAccount.create -}}
{{- default (include "abada.engine.fullname" .) .Values.engine.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.engine.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "abada.broker.serviceAccountName" -}}
{{- if .Values.broker.serviceAccount.create -}}
{{- default (include "abada.broker.fullname" .) .Values.broker.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.broker.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels: app.kubernetes.io/* on everything, plus the component. Call with (list $ "component"). */}}
{{- define "abada.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "abada.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: abada
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels never change across upgrades. Call with (list $ "component"). */}}
{{- define "abada.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "abada.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* A worker pool's selector labels. Call with (list $ $pool). */}}
{{- define "abada.worker.selectorLabels" -}}
{{ include "abada.selectorLabels" (list (index . 0) "worker") }}
abada.dev/worker-pool: {{ (index . 1).poolName }}
{{- end -}}

{{- define "abada.worker.labels" -}}
{{ include "abada.labels" (list (index . 0) "worker") }}
abada.dev/worker-pool: {{ (index . 1).poolName }}
{{- end -}}

{{/* The port a worker serves /healthz and /metrics on (ABADA_WORKER_HEALTH_ADDRESS). */}}
{{- define "abada.worker.healthPort" -}}8081{{- end -}}

{{/* An image reference. Call with (list $ .Values.engine.image). */}}
{{- define "abada.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- $repository := $image.repository -}}
{{- with $root.Values.image.registry -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository -}}
{{- end -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Addresses other components dial. */}}
{{- define "abada.engine.grpcAddress" -}}
{{- printf "%s:%d" (include "abada.engine.fullname" .) (int .Values.engine.grpcPort) -}}
{{- end -}}

{{- define "abada.broker.grpcAddress" -}}
{{- printf "%s:%d" (include "abada.broker.fullname" .) (int .Values.broker.grpcPort) -}}
{{- end -}}

{{/* The engine's HTTP base URL as the KEDA operator (another namespace) reaches it. */}}
{{- define "abada.engine.httpURL" -}}
{{- printf "http://%s.%s.svc.%s:%d" (include "abada.engine.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.engine.httpPort) -}}
{{- end -}}

{{/*
A security context from values (engine, broker, workerDefaults or a pool: podSecurityContext and
securityContext). values.yaml holds the hardened defaults (non-root uid 10001, read-only root, no
capabilities, RuntimeDefault seccomp); Helm merges a user's keys over them. Call with the map.
*/}}
{{- define "abada.securityContext" -}}
{{- if . -}}
{{- toYaml . -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{- define "abada.imagePullSecrets" -}}
{{- with .Values.image.pullSecrets -}}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* NetworkPolicy peer: this release's pods of one component. Call with (list $ "component"). */}}
{{- define "abada.networkPolicy.peer" -}}
- podSelector:
    matchLabels:
      {{- include "abada.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/* NetworkPolicy egress rule for cluster DNS. */}}
{{- define "abada.networkPolicy.dnsEgress" -}}
- to:
    {{- toYaml .Values.networkPolicy.dns.to | nindent 4 }}
  ports:
    {{- toYaml .Values.networkPolicy.dns.ports | nindent 4 }}
{{- end -}}

{{/* NetworkPolicy egress rule for PostgreSQL (the engine and the migration Job only). */}}
{{- define "abada.networkPolicy.postgresqlEgress" -}}
- to:
    {{- toYaml .Values.postgresql.networkPolicy.to | nindent 4 }}
  ports:
    - port: {{ .Values.postgresql.networkPolicy.port }}
      protocol: TCP
{{- end -}}

{{/* The env every container that reads the database gets. */}}
{{- define "abada.databaseEnv" -}}
- name: ABADA_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.postgresql.existingSecret }}
      key: {{ .Values.postgresql.key }}
{{- end -}}

{{/*
A PodDisruptionBudget. Call with (dict "root" $ "name" "..." "selector" "<selector labels yaml>"
"labels" "<labels yaml>" "budget" .podDisruptionBudget). Neither bound set means maxUnavailable: 1.
*/}}
{{- define "abada.podDisruptionBudget" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- .labels | nindent 4 }}
spec:
  {{- if not (kindIs "invalid" .budget.minAvailable) }}
  minAvailable: {{ .budget.minAvailable }}
  {{- else if not (kindIs "invalid" .budget.maxUnavailable) }}
  maxUnavailable: {{ .budget.maxUnavailable }}
  {{- else }}
  maxUnavailable: 1
  {{- end }}
  selector:
    matchLabels:
      {{- .selector | nindent 6 }}
{{- end -}}

{{/*
The Secret holding a TLS certificate: the user's own (tls.existingSecret, tls.broker.existingSecret,
tls.clients.*.existingSecret) or, with tls.certManager.enabled, the one its Certificate writes
(certificates.yaml). Call with (list $ "engine"|"broker"|"broker-client"|"worker-client"|"engine-client").
*/}}
{{- define "abada.tlsSecret" -}}
{{- $root := index . 0 -}}
{{- $which := index . 1 -}}
{{- $tls := $root.Values.tls -}}
{{- $own := dict "engine" $tls.existingSecret "broker" $tls.broker.existingSecret "broker-client" $tls.clients.broker.existingSecret "worker-client" $tls.clients.worker.existingSecret "engine-client" $tls.clients.engine.existingSecret -}}
{{- $named := index $own $which -}}
{{- if $named -}}
{{- $named -}}
{{- else if $tls.certManager.enabled -}}
{{- printf "%s-%s-tls" (include "abada.fullname" $root) $which -}}
{{- end -}}
{{- end -}}

{{/*
With mTLS on the engine, a client (broker, worker) dials it with its own certificate. Each reads
its own variable names: the broker ABADA_ENGINE_TLS_*_FILE (its ABADA_TLS_* would mean nothing to
it), the worker ABADA_TLS_*_FILE like the abada CLI. Env, mount and volume; call with
(list $ "broker"|"worker").
*/}}
{{- define "abada.engineClientTlsEnv" -}}
{{- $root := index . 0 -}}
{{- $prefix := ternary "ABADA_ENGINE_TLS" "ABADA_TLS" (eq (index . 1) "broker") -}}
{{- if $root.Values.tls.enabled }}
- name: {{ $prefix }}_CA_FILE
  value: /etc/abada/engine-tls/ca.crt
- name: {{ $prefix }}_CERT_FILE
  value: /etc/abada/engine-tls/tls.crt
- name: {{ $prefix }}_KEY_FILE
  value: /etc/abada/engine-tls/tls.key
{{- end }}
{{- end -}}

{{- define "abada.engineClientTlsMount" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.tls.enabled }}
- name: engine-tls
  mountPath: /etc/abada/engine-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "abada.engineClientTlsVolume" -}}
{{- $root := index . 0 -}}
{{- $client := index $root.Values.tls.clients (index . 1) -}}
{{- if $root.Values.tls.enabled }}
- name: engine-tls
  secret:
    secretName: {{ include "abada.tlsSecret" (list $root (printf "%s-client" (index . 1))) }}
    defaultMode: 288
    items:
      - key: {{ $root.Values.tls.certKey }}
        path: tls.crt
      - key: {{ $root.Values.tls.keyKey }}
        path: tls.key
      - key: {{ $root.Values.tls.clientCaKey }}
        path: ca.crt
{{- end }}
{{- end -}}

{{/*
With tls.enabled the broker's port speaks TLS: its clients (engine, worker) trust the CA in the
broker's own Secret (only that key is projected into their pods) and, with
tls.broker.requireClientCertificates, present a client certificate: the worker its engine client
certificate, the engine tls.clients.engine. Both read ABADA_BROKER_TLS_{CA,CERT,KEY}_FILE. Env, mounts
and volumes; call with (list $ "engine"|"worker").
*/}}
{{- define "abada.brokerClientTlsEnv" -}}
{{- $root := index . 0 -}}
{{- $tls := $root.Values.tls -}}
{{- if $tls.enabled }}
- name: ABADA_BROKER_TLS_CA_FILE
  value: /etc/abada/broker-ca/ca.crt
{{- if $tls.broker.requireClientCertificates }}
{{- $directory := ternary "/etc/abada/broker-client-tls" "/etc/abada/engine-tls" (eq (index . 1) "engine") }}
- name: ABADA_BROKER_TLS_CERT_FILE
  value: {{ $directory }}/tls.crt
- name: ABADA_BROKER_TLS_KEY_FILE
  value: {{ $directory }}/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{- define "abada.brokerClientTlsMount" -}}
{{- $root := index . 0 -}}
{{- $tls := $root.Values.tls -}}
{{- if $tls.enabled }}
- name: broker-ca
  mountPath: /etc/abada/broker-ca
  readOnly: true
{{- if and $tls.broker.requireClientCertificates (eq (index . 1) "engine") }}
- name: broker-client-tls
  mountPath: /etc/abada/broker-client-tls
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{- define "abada.brokerClientTlsVolume" -}}
{{- $root := index . 0 -}}
{{- $tls := $root.Values.tls -}}
{{- if $tls.enabled }}
- name: broker-ca
  secret:
    secretName: {{ include "abada.tlsSecret" (list $root "broker") }}
    defaultMode: 292 # 0444: a CA certificate is public
    items:
      - key: {{ $tls.clientCaKey }}
        path: ca.crt
{{- if and $tls.broker.requireClientCertificates (eq (index . 1) "engine") }}
- name: broker-client-tls
  secret:
    secretName: {{ include "abada.tlsSecret" (list $root "engine-client") }}
    defaultMode: 288
    items:
      - key: {{ $tls.certKey }}
        path: tls.crt
      - key: {{ $tls.keyKey }}
        path: tls.key
{{- end }}
{{- end }}
{{- end -}}
