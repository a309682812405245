"""JSON Schemas for the kinds kubernetes-validate has none for: the CRDs of the monitoring overlay, the
LeaderWorkerSet of parallel cores, and kustomize's Kustomization.

Life cycle: constants read by `k8s_check`. Each is the part of the upstream
schema (Prometheus Operator `monitoring.coreos.com/v1` ServiceMonitor, KEDA
`keda.sh/v1alpha1` ScaledObject, LWS `leaderworkerset.x-k8s.io/v1` LeaderWorkerSet, kustomize `v1beta1`
Kustomization) covering
the fields edgecore renders, closed with `additionalProperties: false` so a
misspelt or misplaced field fails as `--strict` does for built-in kinds.
"""

from __future__ import annotations

STR = {"type": "string"}
INT = {"type": "integer"}
STR_MAP = {"type": "object", "additionalProperties": STR}


def _closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


METADATA = _closed({"name": STR, "namespace": STR, "labels": STR_MAP, "annotations": STR_MAP}, ("name",))
LABEL_SELECTOR = _closed({"matchLabels": STR_MAP, "matchExpressions": {"type": "array", "items": _closed(
    {"key": STR, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
     "values": {"type": "array", "items": STR}}, ("key", "operator"))}})


_KEY_REF = _closed({"name": STR, "key": STR, "optional": {"type": "boolean"}}, ("key",))
# Prometheus Operator SafeTLSConfig: a Secret's or ConfigMap's key (exactly one of the two)
_SECRET_OR_CONFIG_MAP = {**_closed({"secret": _KEY_REF, "configMap": _KEY_REF}),
                         "oneOf": [{"required": ["secret"]}, {"required": ["configMap"]}]}
TLS_CONFIG = _closed({"ca": _SECRET_OR_CONFIG_MAP, "cert": _SECRET_OR_CONFIG_MAP, "keySecret": _KEY_REF,
                      "serverName": STR, "insecureSkipVerify": {"type": "boolean"},
                      "caFile": STR, "certFile": STR, "keyFile": STR})


def _object(api_version: str, kind: str, spec: dict) -> dict:
    return _closed({"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": METADATA,
                    "spec": spec}, ("apiVersion", "kind", "metadata", "spec"))


SERVICE_MONITOR = _object("monitoring.coreos.com/v1", "ServiceMonitor", _closed({
    "selector": LABEL_SELECTOR,
    "namespaceSelector": _closed({"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": STR}}),
    "jobLabel": STR,
    "targetLabels": {"type": "array", "items": STR},
    "podTargetLabels": {"type": "array", "items": STR},
    "endpoints": {"type": "array", "minItems": 1, "items": _closed({
        "port": STR, "targetPort": {"type": ["string", "integer"]}, "path": STR,
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                                  r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
        "scrapeTimeout": STR, "honorLabels": {"type": "boolean"}, "tlsConfig": TLS_CONFIG})},
}, ("selector",)))

SCALED_OBJECT = _object("keda.sh/v1alpha1", "ScaledObject", _closed({
    "scaleTargetRef": _closed({"apiVersion": STR, "kind": STR, "name": STR, "envSourceContainerName": STR},
                              ("name",)),
    "pollingInterval": INT, "cooldownPeriod": INT, "initialCooldownPeriod": INT, "idleReplicaCount": INT,
    "minReplicaCount": {"type": "integer", "minimum": 0}, "maxReplicaCount": {"type": "integer", "minimum": 1},
    "fallback": _closed({"failureThreshold": INT, "replicas": INT}, ("failureThreshold", "replicas")),
    "triggers": {"type": "array", "minItems": 1, "items": _closed({
        "type": STR, "name": STR, "useCachedMetrics": {"type": "boolean"},
        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
        "metadata": STR_MAP,                   # KEDA reads every trigger setting as a string
        "authenticationRef": _closed({"name": STR, "kind": STR}, ("name",))}, ("type", "metadata"))},
}, ("scaleTargetRef", "triggers")))

_PATCH = _closed({"path": STR, "patch": STR, "target": _closed({
    "group": STR, "version": STR, "kind": STR, "name": STR, "namespace": STR, "labelSelector": STR,
    "annotationSelector": STR})})
_GENERATOR = _closed({"name": STR, "namespace": STR, "behavior": {"enum": ["create", "replace", "merge"]},
                      "type": STR, "files": {"type": "array", "items": STR},
                      "literals": {"type": "array", "items": STR}, "envs": {"type": "array", "items": STR},
                      "options": _closed({"disableNameSuffixHash": {"type": "boolean"}, "labels": STR_MAP,
                                          "annotations": STR_MAP})}, ("name",))

KUSTOMIZATION = _closed({
    "apiVersion": {"const": "kustomize.config.k8s.io/v1beta1"}, "kind": {"const": "Kustomization"},
    "namespace": STR, "namePrefix": STR, "nameSuffix": STR,
    "resources": {"type": "array", "items": STR}, "components": {"type": "array", "items": STR},
    "patches": {"type": "array", "items": _PATCH},
    "secretGenerator": {"type": "array", "items": _GENERATOR},
    "configMapGenerator": {"type": "array", "items": _GENERATOR},
    "labels": {"type": "array", "items": _closed({"pairs": STR_MAP, "includeSelectors": {"type": "boolean"},
                                                  "includeTemplates": {"type": "boolean"}})},
}, ("apiVersion", "kind"))

_INT_OR_PERCENT = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^[0-9]+%$"}]}
# LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): its pod templates are {"type": "object"} here and checked as Pods
# against Kubernetes' own strict schema (`LWS_POD_TEMPLATES`, k8s_check), its claim templates as
# PersistentVolumeClaims.
LEADER_WORKER_SET = _object("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", _closed({
    "replicas": {"type": "integer", "minimum": 0},
    "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
    "rolloutStrategy": _closed({"type": {"enum": ["RollingUpdate"]}, "rollingUpdateConfiguration": _closed({
        "partition": {"type": "integer", "minimum": 0}, "maxUnavailable": _INT_OR_PERCENT,
        "maxSurge": _INT_OR_PERCENT})}, ("type",)),
    "leaderWorkerTemplate": _closed({
        "size": {"type": "integer", "minimum": 1},
        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None", "Default"]},
        "leaderTemplate": {"type": "object"}, "workerTemplate": {"type": "object"},
        "volumeClaimTemplates": {"type": "array", "items": {"type": "object"}}}, ("workerTemplate",)),
}, ("leaderWorkerTemplate",)))
LWS_POD_TEMPLATES = ("leaderTemplate", "workerTemplate")

CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
        ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): LEADER_WORKER_SET}
