{{/*
Names, labels and the one role-parameterised container: every Deployment of the chart
is rendered from these by templates/deployment.yaml.
*/}}

{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The image repository values.yaml names: a placeholder nothing publishes. */}}
{{- define "baton.defaultRepository" -}}ghcr.io/baton-llm/baton{{- end }}

{{/* Labels of every object; pass (dict "root" $ "component" NAME). */}}
{{- define "baton.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "baton.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: baton
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}

{{/* Selector labels of one workload; pass (dict "root" $ "component" NAME). */}}
{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
The workloads the mode renders, as a YAML list: name (object suffix and component label),
block (the values block with replicas, autoscaling, pdb, placement), containers (the
roles it runs) and pair (true: those roles run as two processes of one container, see
baton.container's "pair").
*/}}
{{- define "baton.workloads" -}}
- {name: gateway, block: gateway, containers: [gateway]}
{{- if eq .Values.mode "disaggregated" }}
- {name: prefill, block: prefill, containers: [prefill]}
- {name: decode, block: decode, containers: [decode]}
{{- else if eq .Values.mode "single" }}
- {name: single, block: decode, containers: [single]}
{{- else if eq .Values.mode "colocated" }}
- {name: colocated, block: decode, containers: [prefill, decode], pair: {{ eq .Values.transfer.transport "cuda_ipc" }}}
{{- else }}
{{- fail (printf "mode must be disaggregated, single or colocated, got %q" .Values.mode) }}
{{- end }}
{{- end }}

{{/*
The `role` label of the worker series a workload scales on: a co-located pod exports the
series of both its workers, and the autoscaler must read one (the decode worker's, whose
block it takes), not their sum; single-process workers label theirs "both"; "" for the
gateway (its series carry no role).
*/}}
{{- define "baton.metricRole" -}}
{{- if eq . "colocated" }}decode{{ else if eq . "single" }}both{{ else if ne . "gateway" }}{{ . }}{{ end }}
{{- end }}

{{/*
True when a pod gets a memory-backed /dev/shm (volume dshm): co-located pods (decode's KV
pool lives there) and GPU pods (NCCL and torch use it). Pass (dict "root" $ "block"
NAME), the values block of the workload (or of the container's role: the same block
outside co-located pods); never the gateway's (it computes nothing).
*/}}
{{- define "baton.sharedMemory" -}}
{{- $v := .root.Values }}
{{- if and (ne .block "gateway") (or (eq $v.mode "colocated") (gt (int (index $v .block).gpus) 0)) }}true{{ end }}
{{- end }}

{{/* The values block of a container role (single-process workers and the co-located
pair use decode's). */}}
{{- define "baton.roleBlock" -}}
{{- if has . (list "single" "pair") }}decode{{ else }}{{ . }}{{ end }}
{{- end }}

{{/* The BATON_<PREFIX>_ of a container role. */}}
{{- define "baton.envPrefix" -}}
{{- if eq . "gateway" }}BATON_GATEWAY_{{ else if eq . "prefill" }}BATON_PREFILL_{{ else }}BATON_DECODE_{{ end }}
{{- end }}

{{/* Port names of a container role: unique within a co-located pod. */}}
{{- define "baton.grpcPortName" -}}
{{- if eq . "gateway" }}grpc{{ else if eq . "prefill" }}grpc-prefill{{ else }}grpc-decode{{ end }}
{{- end }}
{{- define "baton.metricsPortName" -}}
{{- if eq . "gateway" }}metrics{{ else if eq . "prefill" }}metrics-prefill{{ else }}metrics-decode{{ end }}
{{- end }}

{{/* True when KV crosses pods: gloo/nccl/nixl between prefill and decode Deployments. */}}
{{- define "baton.crossPodKV" -}}
{{- if and (eq .Values.mode "disaggregated") (has .Values.transfer.transport (list "gloo" "nccl" "nixl")) }}true{{ end }}
{{- end }}

{{/* True when decode workers run a KV rendezvous store that prefill pods dial (gloo/nccl
between pods; nixl's agents exchange what they need inside the hand-off messages). */}}
{{- define "baton.kvStore" -}}
{{- if and (include "baton.crossPodKV" .) (has .Values.transfer.transport (list "gloo" "nccl")) }}true{{ end }}
{{- end }}

{{/* The headless Service name of a workload. */}}
{{- define "baton.serviceName" -}}
{{ include "baton.fullname" .root }}-{{ .name }}
{{- end }}

{{/*
dns:/// target of a worker workload's port: the headless Service's short name, which the
pod's DNS search path resolves in its own namespace first (so a kustomize namespace
change keeps it right).
*/}}
{{- define "baton.target" -}}
dns:///{{ include "baton.fullname" .root }}-{{ .name }}:{{ .port }}
{{- end }}

{{/*
model.source hf: the directory the init step fetches into (the repo and revision, each a
path segment), and the checkpoint directory in it that every service loads (named for the
repo, so the gateway serves it under that name); see engine/model_fetch.py.
*/}}
{{- define "baton.hfDest" -}}
{{- $m := .Values.model }}
{{- if not (regexMatch "^[A-Za-z0-9][-_.A-Za-z0-9]*/[-_.A-Za-z0-9]+$" $m.name) }}
{{- fail (printf "model.name must be ORG/NAME (a Hugging Face repo) when model.source is hf, got %q" $m.name) }}
{{- end }}
{{- printf "%s/%s/%s" (trimSuffix "/" $m.mountPath) (replace "/" "--" $m.name) (replace "/" "--" $m.revision) }}
{{- end }}
{{- define "baton.hfCheckpoint" -}}
{{- printf "%s/%s" (include "baton.hfDest" .) (regexReplaceAll "^.*/" .Values.model.name "") }}
{{- end }}

{{/*
The init container of model.source hf, in every pod; pass (dict "root" $ "block" BLOCK
"tokenizerOnly" BOOL). It downloads the model into the model volume (writable here only)
before the services start; the gateway's skips the weights of a safetensors repo. It runs
with the pod block's resources (a GGUF conversion holds the model in memory), no GPU.
*/}}
{{- define "baton.fetchInit" -}}
{{- $root := .root }}
{{- $m := $root.Values.model -}}
- name: fetch-model
  image: "{{ $root.Values.image.repository }}:{{ $root.Values.image.tag }}"
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  args:
    - fetch-model
    - --repo
    - {{ $m.name | quote }}
    - --revision
    - {{ $m.revision | quote }}
    - --dest
    - {{ include "baton.hfDest" $root | quote }}
    {{- if $m.ggufFile }}
    - --gguf-file
    - {{ $m.ggufFile | quote }}
    {{- else if .tokenizerOnly }}
    - --tokenizer-only
    - "true"
    {{- end }}
    {{- if $m.hf.tokenSecret }}
    - --token-file
    - {{ printf "%s/%s" (include "baton.secretDir" "hf-token") $m.hf.tokenKey | quote }}
    {{- end }}
  env:
    {{- range include "baton.jitCacheEnv" . | fromYamlArray }}
    - name: {{ .name }}
      value: {{ .value | quote }}
    {{- end }}
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- if $m.hf.endpoint }}
    - name: HF_ENDPOINT
      value: {{ $m.hf.endpoint | quote }}
    {{- end }}
  resources:
    {{- $resources := deepCopy (default dict .block.resources) }}
    {{- toYaml $resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: cache
      mountPath: {{ include "baton.cacheHome" . }}
    - name: tmp
      mountPath: /tmp
    - name: model
      mountPath: {{ $m.mountPath }}
    {{- if $m.hf.tokenSecret }}
    - name: hf-token
      mountPath: {{ include "baton.secretDir" "hf-token" }}
      readOnly: true
    {{- end }}
{{- end }}

{{/* Where the model is, as every service's --model sees it. */}}
{{- define "baton.modelPath" -}}
{{- if eq .Values.model.source "image" }}
{{- .Values.model.name }}
{{- else if eq .Values.model.source "hf" }}
{{- include "baton.hfCheckpoint" . }}
{{- else if .Values.model.name }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.name) }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/* The writable cache emptyDir (the root file system is read-only). */}}
{{- define "baton.cacheHome" -}}/home/baton/.cache{{- end }}
{{- define "baton.cacheDir" -}}{{ include "baton.cacheHome" . }}/baton/models{{- end }}

{{/*
Every JIT cache pointed into the cache emptyDir: Triton (kernels and their launchers,
compiled at first use), TorchInductor, the CUDA driver's PTX cache and XDG's. Their
defaults lie under $HOME, which the read-only root makes unwritable. The image sets the
same values; the chart sets them too, so another image or HOME cannot move them.
*/}}
{{- define "baton.jitCacheEnv" -}}
{{- $home := include "baton.cacheHome" . }}
- {name: XDG_CACHE_HOME, value: {{ $home | quote }}}
- {name: TRITON_HOME, value: {{ $home | quote }}}
- {name: TRITON_CACHE_DIR, value: {{ printf "%s/triton" $home | quote }}}
- {name: TORCHINDUCTOR_CACHE_DIR, value: {{ printf "%s/torchinductor" $home | quote }}}
- {name: CUDA_CACHE_PATH, value: {{ printf "%s/nv" $home | quote }}}
{{- end }}

{{/*
The Secrets a container role mounts, as a YAML list of {name, secretName}: each is a
volume of the pod, mounted read-only at /etc/baton/<name> (baton.secretDir). The gateway
serves with gateway-tls and checks api-keys; every role but a single-process worker's
KV needs the fleet's certificate, and workers that hand KV over the fleet secret.
*/}}
{{- define "baton.secrets" -}}
{{- $s := .root.Values.security }}
{{- if and (eq .role "gateway") $s.gatewayTls.secretName }}
- {name: gateway-tls, secretName: {{ $s.gatewayTls.secretName | quote }}}
{{- end }}
{{- if and (eq .role "gateway") $s.apiKeys.secretName }}
- {name: api-keys, secretName: {{ $s.apiKeys.secretName | quote }}}
{{- end }}
{{- if $s.fleetTls.secretName }}
- {name: fleet-tls, secretName: {{ $s.fleetTls.secretName | quote }}}
{{- end }}
{{- if and (has .role (list "prefill" "decode" "pair")) $s.fleetSecret.secretName }}
- {name: fleet-secret, secretName: {{ $s.fleetSecret.secretName | quote }}}
{{- end }}
{{- end }}

{{/* Where a Secret volume is mounted. */}}
{{- define "baton.secretDir" -}}/etc/baton/{{ . }}{{- end }}

{{/*
The handler of a container's probes; pass (dict "root" $ "role" ROLE "block" BLOCK
"alive" BOOL). alive: the check passes once the server listens, ready or not (health
service baton.alive, HTTP /alive), for the gateway's startup and liveness probes, so a
gateway waiting for its decode workers starts and is not restarted.
Kubernetes' native gRPC probe dials plaintext, so a TLS port gets another one: python -m
rpc.probe (a grpc.health.v1 Check over TLS, with the fleet's certificate for mTLS
workers), or for a TLS gateway with HTTP on an HTTPS GET of /health (200 only while
SERVING, like the gRPC health).
*/}}
{{- define "baton.probeHandler" -}}
{{- $s := .root.Values.security }}
{{- $address := printf "127.0.0.1:%v" .block.port }}
{{- if and (eq .role "gateway") $s.gatewayTls.secretName }}
{{- if .root.Values.http.enabled }}
httpGet:
  path: {{ ternary "/alive" "/health" (default false .alive) }}
  port: http
  scheme: HTTPS
{{- else }}
exec:
  command:
    - python
    - -m
    - rpc.probe
    - --address
    - {{ $address | quote }}
    - --tls-ca
    - {{ printf "%s/%s" (include "baton.secretDir" "gateway-tls") $s.gatewayTls.caKey | quote }}
    - --tls-server-name
    - {{ required "security.gatewayTls.serverName is required: the gateway's exec probe checks its certificate against it (or turn http on for HTTPS /health probes)" $s.gatewayTls.serverName | quote }}
    {{- if .alive }}
    - --service
    - baton.alive
    {{- end }}
    - --timeout-s
    - "5"
{{- end }}
{{- else if and (ne .role "gateway") $s.fleetTls.secretName }}
{{- $dir := include "baton.secretDir" "fleet-tls" }}
exec:
  command:
    - python
    - -m
    - rpc.probe
    - --address
    - {{ $address | quote }}
    - --tls-cert
    - {{ printf "%s/tls.crt" $dir | quote }}
    - --tls-key
    - {{ printf "%s/tls.key" $dir | quote }}
    - --tls-ca
    - {{ printf "%s/ca.crt" $dir | quote }}
    - --tls-server-name
    - {{ $s.fleetTls.serverName | quote }}
    - --timeout-s
    - "5"
{{- else }}
grpc:
  port: {{ .block.port }}
  {{- if .alive }}
  service: baton.alive
  {{- end }}
{{- end }}
{{- end }}

{{/* Liveness must outlast a drain (NOT_SERVING from SIGTERM until exit). */}}
{{- define "baton.livenessFailures" -}}
{{- $b := .block }}
{{- $need := add (div (add $b.preStopSleepS $b.graceS) $b.probes.liveness.periodSeconds) 2 }}
{{- max $b.probes.liveness.failureThreshold $need }}
{{- end }}

{{/* The worker processes a container role runs (the pair: prefill, then decode). */}}
{{- define "baton.processes" -}}
{{- if eq . "pair" }}[prefill, decode]{{ else }}[{{ . }}]{{ end }}
{{- end }}

{{/*
One container of a role; pass (dict "root" $ "role" ROLE). Flags that locate the process
(host, ports, drain) are arguments; everything else comes from the ConfigMap as
BATON_<ROLE>_* environment twins, plus the pod IP as the advertise host of workers and
their CPU request as the bound of their compute team.

Role "pair" (co-located cuda_ipc) runs the prefill and the decode worker as two processes
of this one container (baton-entrypoint pair PREFILL_FLAGS -- DECODE_FLAGS), so both use
the one GPU it requests: CUDA IPC needs both on one device, and the NVIDIA device plugin
gives every container that requests nvidia.com/gpu devices of its own (two containers
asking for one each get two different GPUs; one that asks for none gets none). Its
resources are decode's (size them for both processes); its probes check the decode
worker (the gateway checks the prefill worker's health itself, and the entrypoint
restarts the container when either process exits).
*/}}
{{- define "baton.container" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $block := index $root.Values (include "baton.roleBlock" $role) }}
{{- $processes := include "baton.processes" $role | fromYamlArray -}}
- name: {{ $role }}
  image: "{{ $root.Values.image.repository }}:{{ $root.Values.image.tag }}"
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  args:
    - {{ $role }}
    {{- range $i, $p := $processes }}
    {{- $b := index $root.Values (include "baton.roleBlock" $p) }}
    {{- if $i }}
    - "--"
    {{- end }}
    - --host
    - "0.0.0.0"
    - --port
    - {{ $b.port | quote }}
    - --metrics-port
    - {{ $b.metricsPort | quote }}
    - --grace-s
    - {{ $b.graceS | quote }}
    {{- if and (eq $p "gateway") $root.Values.http.enabled }}
    - --http-port
    - {{ $root.Values.http.port | quote }}
    {{- end }}
    {{- end }}
  env:
    {{- range include "baton.jitCacheEnv" . | fromYamlArray }}
    - name: {{ .name }}
      value: {{ .value | quote }}
    {{- end }}
    {{- range $p := $processes }}
    {{- if ne $p "gateway" }}
    - name: {{ include "baton.envPrefix" $p }}ADVERTISE_HOST
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    {{- /* The cores the pod was granted bound numThreads 0 (rpc.worker_cpus): without
    a CPU limit there is no cgroup quota, and torch would size its team by the node. */}}
    - name: {{ include "baton.envPrefix" $p }}CPU_LIMIT
      valueFrom:
        resourceFieldRef:
          resource: requests.cpu
          divisor: "1"
    {{- end }}
    {{- end }}
    {{- range $p := $processes }}
    {{- with (index $root.Values (include "baton.roleBlock" $p)).env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- end }}
  envFrom:
    - configMapRef:
        name: {{ include "baton.fullname" $root }}-config
  ports:
    {{- range $p := $processes }}
    {{- $b := index $root.Values (include "baton.roleBlock" $p) }}
    - name: {{ include "baton.grpcPortName" $p }}
      containerPort: {{ $b.port }}
      protocol: TCP
    {{- if and (eq $p "gateway") $root.Values.http.enabled }}
    - name: http
      containerPort: {{ $root.Values.http.port }}
      protocol: TCP
    {{- end }}
    {{- if $b.metricsPort }}
    - name: {{ include "baton.metricsPortName" $p }}
      containerPort: {{ $b.metricsPort }}
      protocol: TCP
    {{- end }}
    {{- if and (eq $p "decode") (include "baton.kvStore" $root) }}
    - name: kv-store
      containerPort: {{ $root.Values.transfer.storePort }}
      protocol: TCP
    {{- end }}
    {{- end }}
  {{- $probe := include "baton.probeHandler" (dict "root" $root "role" $role "block" $block) | trim }}
  {{- $alive := include "baton.probeHandler" (dict "root" $root "role" $role "block" $block "alive" (eq $role "gateway")) | trim }}
  {{- /* An exec probe starts a Python process: give it at least 10 s. */}}
  {{- $least := ternary 10 1 (hasPrefix "exec:" $probe) }}
  startupProbe:
    {{- $alive | nindent 4 }}
    periodSeconds: {{ $block.probes.startup.periodSeconds }}
    failureThreshold: {{ $block.probes.startup.failureThreshold }}
    timeoutSeconds: {{ max $least (default 1 $block.probes.startup.timeoutSeconds) }}
  readinessProbe:
    {{- $probe | nindent 4 }}
    periodSeconds: {{ $block.probes.readiness.periodSeconds }}
    failureThreshold: {{ $block.probes.readiness.failureThreshold }}
    timeoutSeconds: {{ max $least (default 1 $block.probes.readiness.timeoutSeconds) }}
  livenessProbe:
    {{- $alive | nindent 4 }}
    periodSeconds: {{ $block.probes.liveness.periodSeconds }}
    failureThreshold: {{ include "baton.livenessFailures" (dict "block" $block) }}
    timeoutSeconds: {{ max $least (default 1 $block.probes.liveness.timeoutSeconds) }}
  {{- if $block.preStopSleepS }}
  lifecycle:
    preStop:
      sleep:
        seconds: {{ $block.preStopSleepS }}
  {{- end }}
  resources:
    {{- $resources := deepCopy (default dict $block.resources) }}
    {{- if $block.gpus }}
    {{- $limits := default dict $resources.limits }}
    {{- $_ := set $limits "nvidia.com/gpu" $block.gpus }}
    {{- $_ := set $resources "limits" $limits }}
    {{- $requests := default dict $resources.requests }}
    {{- $_ := set $requests "nvidia.com/gpu" $block.gpus }}
    {{- $_ := set $resources "requests" $requests }}
    {{- end }}
    {{- toYaml $resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: cache
      mountPath: {{ include "baton.cacheHome" . }}
    - name: tmp
      mountPath: /tmp
    {{- if ne $root.Values.model.source "image" }}
    - name: model
      mountPath: {{ $root.Values.model.mountPath }}
      readOnly: true
    {{- end }}
    {{- if include "baton.sharedMemory" (dict "root" $root "block" (include "baton.roleBlock" $role)) }}
    - name: dshm
      mountPath: /dev/shm
    {{- end }}
    {{- range include "baton.secrets" (dict "root" $root "role" $role) | fromYamlArray }}
    - name: {{ .name }}
      mountPath: {{ include "baton.secretDir" .name }}
      readOnly: true
    {{- end }}
{{- end }}

{{/* A setting's value as an environment string: whole numbers without an exponent. */}}
{{- define "baton.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}
{{- int64 . | toString }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}
