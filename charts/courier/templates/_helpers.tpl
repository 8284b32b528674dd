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
