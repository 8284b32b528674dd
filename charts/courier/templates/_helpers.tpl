{{/* The chart name, or nameOverride. */}}
{{- define "courier.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every resource name. */}}
{{- define "courier.fullname" -}}
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

{{/* The injector's Deployment, Service and ServiceAccount name. */}}
{{- define "courier.injector" -}}
{{- printf "%s-injector" (include "courier.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding the injector's serving certificate. */}}
{{- define "courier.tlsSecret" -}}
{{- if and (not .Values.certManager.enabled) .Values.generatedCertificate.existingSecret }}
{{- .Values.generatedCertificate.existingSecret }}
{{- else }}
{{- printf "%s-injector-tls" (include "courier.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "courier.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "courier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the injector's pods. */}}
{{- define "courier.injectorSelector" -}}
app.kubernetes.io/name: {{ include "courier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: injector
{{- end }}

{{/* The injector's image. */}}
{{- define "courier.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The sidecar's image: sidecar.image, falling back to image. */}}
{{- define "courier.sidecarImage" -}}
{{- $repository := default .Values.image.repository .Values.sidecar.image.repository }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.sidecar.image.tag }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{/*
Fails the render when a value asks for an object whose API the cluster does
not serve, naming what to install; an object the API server would refuse
halfway through an install is worse. `helm template` knows only the APIs
given with --api-versions (Argo CD and Flux pass the cluster's).
Call with (dict "ctx" $ "api" "group/version/Kind" "value" "the.value" "install" "what").
*/}}
{{- define "courier.requireAPI" -}}
{{- if not (.ctx.Capabilities.APIVersions.Has .api) }}
{{- fail (printf "%s=true needs the API %s, which this cluster does not serve: install %s first, or leave %s false (with helm template, pass --api-versions %s)" .value .api .install .value .api) }}
{{- end }}
{{- end }}

{{/* The console's Deployment, Service and ConfigMap name. */}}
{{- define "courier.console" -}}
{{- printf "%s-console" (include "courier.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the console's pods. */}}
{{- define "courier.consoleSelector" -}}
app.kubernetes.io/name: {{ include "courier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: console
{{- end }}

{{/* The environment variable that carries console.queues[i]'s broker URL. */}}
{{- define "courier.consoleSourceEnv" -}}
{{- printf "COURIER_CONSOLE_SOURCE_%d" . }}
{{- end }}

{{/*
The console's queues.yaml: each queue of console.queues with its broker URL
named by sourceEnv (the variable the Deployment fills from sourceSecret), so
that no URL, and no password in one, is ever in the ConfigMap. Fails the
render on a queue the console could not use.
*/}}
{{- define "courier.consoleQueuesFile" -}}
{{- $queues := list }}
{{- if not .Values.console.queues }}
{{- fail "console.enabled=true needs at least one queue in console.queues, each {queue, sourceSecret: {name, key}} (see docs/kubernetes.md#console)" }}
{{- end }}
{{- range $i, $q := .Values.console.queues }}
{{- if not $q.queue }}
{{- fail (printf "console.queues[%d] has no queue: each queue needs queue (the queue's name, as the sidecar's --queue takes it) and sourceSecret {name, key} (the Secret holding its broker URL)" $i) }}
{{- end }}
{{- $secret := $q.sourceSecret | default dict }}
{{- if not (and $secret.name $secret.key) }}
{{- fail (printf "console.queues[%d] (queue %s) needs sourceSecret {name, key}: the Secret in namespace %s and its key holding the broker URL, e.g. sourceSecret: {name: orders-broker, key: url}" $i $q.queue $.Release.Namespace) }}
{{- end }}
{{- $entry := dict "queue" $q.queue "sourceEnv" (include "courier.consoleSourceEnv" $i) }}
{{- with $q.name }}{{ $_ := set $entry "name" . }}{{ end }}
{{- with $q.dlq }}{{ $_ := set $entry "dlq" . }}{{ end }}
{{- $queues = append $queues $entry }}
{{- end }}
{{- toYaml (dict "queues" $queues) }}
{{- end }}

{{/* Whether the console has a token: console.tokenSecret, checked whole. */}}
{{- define "courier.consoleToken" -}}
{{- with .Values.console.tokenSecret }}
{{- if not (and .name .key) }}
{{- fail "console.tokenSecret needs both name and key: the Secret in the release namespace and its key holding the bearer token, or {} for no token" }}
{{- end }}
{{- "true" }}
{{- end }}
{{- end }}
