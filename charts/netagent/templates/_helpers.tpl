{{/* The "netagent" part of names: <fullname>-agent, <fullname>-controller. */}}
{{- define "netagent.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "netagent.agent" -}}{{ include "netagent.fullname" . }}-agent{{- end -}}
{{- define "netagent.controller" -}}{{ include "netagent.fullname" . }}-controller{{- end -}}
{{- define "netagent.cleanup" -}}{{ include "netagent.fullname" . }}-cleanup{{- end -}}

{{/* Labels on every object. */}}
{{- define "netagent.labels" -}}
app.kubernetes.io/part-of: netagent
{{- if not .Values.staticManifests }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The image: repository:tag, or repository@digest when a digest is given. */}}
{{- define "netagent.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The URL agents report to. */}}
{{- define "netagent.controllerURL" -}}
{{- if .Values.controller.url -}}
{{- .Values.controller.url -}}
{{- else -}}
{{- printf "%s://%s.%s.svc:%d" (ternary "https" "http" .Values.tls.enabled) (include "netagent.controller" .) .Release.Namespace (int .Values.controller.port) -}}
{{- end -}}
{{- end -}}

{{/* The controller Service's names, as agents in the cluster use them: the serving certificate's
SANs (with tls.dnsNames), and the agents' host aliases for a fixed ClusterIP. */}}
{{- define "netagent.serviceNames" -}}
{{- $svc := include "netagent.controller" . -}}
{{- $ns := .Release.Namespace -}}
{{- list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) | toJson -}}
{{- end -}}

{{/* The agent's and the cleanup's container securityContext: NET_ADMIN and NET_RAW, nothing else. */}}
{{- define "netagent.nodeSecurityContext" -}}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
# capabilities reach a process only as uid 0 (Kubernetes sets no ambient capabilities)
runAsUser: 0
runAsGroup: 0
runAsNonRoot: false
capabilities:
  drop: ["ALL"]
  add: {{ include "netagent.nodeCapabilities" . }}
{{- end -}}

{{/* The node profile's capabilities: BPF too where the agent counts internal bytes on the pods' devices. */}}
{{- define "netagent.nodeCapabilities" -}}
{{- if .Values.agent.deviceCounting.enabled -}}
["NET_ADMIN", "NET_RAW", "BPF"]
{{- else -}}
["NET_ADMIN", "NET_RAW"]
{{- end -}}
{{- end -}}

{{/* The bpf filesystem the device counter pins its map in (a host path, mounted where the agent looks). */}}
{{- define "netagent.bpfMount" -}}
- name: bpf
  mountPath: /sys/fs/bpf
{{- end -}}
{{- define "netagent.bpfVolume" -}}
- name: bpf
  hostPath:
    path: {{ .Values.agent.deviceCounting.bpfHostPath }}
    type: Directory
{{- end -}}

{{/* The non-root securityContext (the controller; the cleanup's idle container): "restricted". */}}
{{- define "netagent.restrictedSecurityContext" -}}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* A PodDisruptionBudget's minAvailable or maxUnavailable (one of them: the API server refuses both).
     Arguments: pdb (the value), where (its name, for the message). */}}
{{- define "netagent.pdbSpec" -}}
{{- $min := .pdb.minAvailable }}{{ $max := .pdb.maxUnavailable }}
{{- if and (not (kindIs "invalid" $min)) (not (kindIs "invalid" $max)) }}
{{- fail (printf "%s: minAvailable=%v and maxUnavailable=%v are both set; expected one of them (set the other to null), e.g. {maxUnavailable: 1}" .where $min $max) }}
{{- end }}
{{- if not (kindIs "invalid" $min) }}
minAvailable: {{ $min }}
{{- else if not (kindIs "invalid" $max) }}
maxUnavailable: {{ $max }}
{{- else }}
{{- fail (printf "%s: neither minAvailable nor maxUnavailable is set; expected one of them, e.g. {maxUnavailable: 1}" .where) }}
{{- end }}
{{- end -}}
