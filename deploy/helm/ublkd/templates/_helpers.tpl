{{/* The ublkd image, for ublkd, its init container and the CSI driver alike. */}}
{{- define "ublkd.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}
{{- end }}

{{/* The pull policy line of a container, when one is set. */}}
{{- define "ublkd.pullPolicy" -}}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{/* Labels of every object: the project's, Helm's, and the operator's own (labels). */}}
{{- define "ublkd.labels" -}}
app.kubernetes.io/part-of: ublkd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A pod template's metadata, called with (list . NAME): its name, the release, podLabels
and podAnnotations. The selectors match on the name only (immutable once installed). */}}
{{- define "ublkd.podMetadata" -}}
{{- $ := index . 0 -}}
labels:
  app.kubernetes.io/name: {{ index . 1 }}
  app.kubernetes.io/part-of: ublkd
  app.kubernetes.io/instance: {{ $.Release.Name }}
  {{- with $.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A sidecar: its requests and limits, no capability, no escalation, a read-only root. In
the node plugin's pod it runs as root (the sockets and the kubelet's registration directory are
root's); in the resizer's, as the pod's non-root user. */}}
{{- define "ublkd.sidecar" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
  seccompProfile:
    type: RuntimeDefault
{{- with .Values.sidecars.resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The pod securityContext of the Deployments and Jobs: Pod Security "restricted". */}}
{{- define "ublkd.restrictedPod" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  # Secret files (0400) readable by the group: the kubelet gives them to fsGroup.
  fsGroup: 65532
  seccompProfile:
    type: RuntimeDefault
{{- end }}

{{/* A container of the Deployments and Jobs: Pod Security "restricted". */}}
{{- define "ublkd.restrictedContainer" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end }}

{{/* The DNS name of the remote-access Service: every ublkd's server certificate holds it. */}}
{{- define "ublkd.grpcHost" -}}
ublkd-grpc.{{ .Release.Namespace }}.svc
{{- end }}

{{/* A pod's nodeSelector, called with (list . NODE_POD): Linux and the image's architecture
(image.arch) for every pod; the node pods add the operator's nodeSelector, which wins. */}}
{{- define "ublkd.nodeSelector" -}}
{{- $ := index . 0 -}}
{{- $sel := dict "kubernetes.io/os" "linux" "kubernetes.io/arch" $.Values.image.arch -}}
{{- if index . 1 }}
{{- $sel = merge (deepCopy $.Values.nodeSelector) $sel -}}
{{- end }}
nodeSelector:
  {{- toYaml $sel | nindent 2 }}
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
