{{/* The ublkd image, for ublkd, its init container and the CSI driver alike. */}}
{{- define "ublkd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The pull policy line of a container, when one is set. */}}
{{- define "ublkd.pullPolicy" -}}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{/* Labels of every object: the project's, and Helm's own two. */}}
{{- define "ublkd.labels" -}}
app.kubernetes.io/part-of: ublkd
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The DNS name of the remote-access Service: every ublkd's server certificate holds it. */}}
{{- define "ublkd.grpcHost" -}}
ublkd-grpc.{{ .Release.Namespace }}.svc
{{- end }}

{{/* The pods' image pull secrets, when any. */}}
{{- define "ublkd.pullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Refusals: combinations that cannot work. */}}
{{- define "ublkd.checks" -}}
{{- if and .Values.modifyVolume.enabled (not .Values.remoteAccess.enabled) }}
{{- fail "modifyVolume.enabled needs remoteAccess.enabled: the resizer's driver reaches each node's ublkd through it" }}
{{- end }}
{{- if and .Values.remoteAccess.certManager.enabled (not .Values.remoteAccess.enabled) }}
{{- fail "remoteAccess.certManager.enabled needs remoteAccess.enabled" }}
{{- end }}
{{- if not .Values.ublkd.fileRoots }}
{{- fail "ublkd.fileRoots needs at least one directory" }}
{{- end }}
{{- range .Values.storageClasses }}
{{- if and (eq .backend "file") (not (has .root $.Values.ublkd.fileRoots)) }}
{{- fail (printf "StorageClass %s: root %s is not one of ublkd.fileRoots" .name .root) }}
{{- end }}
{{- end }}
{{- end }}
