"""Offline checks of rendered objects: strict Kubernetes schema validation, schemas of the
fields the chart writes into the two CRDs it may render (Prometheus Operator's
ServiceMonitor, KEDA's ScaledObject), and the YAML lint every render must pass."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
from yamllint import linter
from yamllint.config import YamlLintConfig

# Every object validates against the oldest Kubernetes the chart admits (Chart.yaml's
# kubeVersion) and the newest schema at hand.
KUBE_VERSION = kubernetes_validate.utils.latest_version()
OLDEST_KUBE_VERSION = "1.30.0"
KUBE_VERSIONS = (OLDEST_KUBE_VERSION, KUBE_VERSION)

# The fields of the two CRDs the chart renders, strictly (what the chart writes must be
# spelled as the operators read it).
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": _STR_MAP},
}
_POLICY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "value", "periodSeconds"],
    "properties": {
        "type": {"enum": ["Pods", "Percent"]},
        "value": {"type": "integer", "minimum": 1},
        "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
    },
}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"matchLabels": _STR_MAP},
                    },
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["port"],
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            },
                        },
                    },
                },
            },
        },
    },
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": {"type": "string"},
                        },
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "advanced": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "behavior": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "scaleDown": {
                                                "type": "object",
                                                "additionalProperties": False,
                                                "properties": {
                                                    "stabilizationWindowSeconds": {
                                                        "type": "integer",
                                                        "minimum": 0,
                                                        "maximum": 3600,
                                                    },
                                                    "policies": {"type": "array", "items": _POLICY},
                                                },
                                            }
                                        },
                                    }
                                },
                            }
                        },
                    },
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"enum": ["prometheus", "cpu"]},
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "metadata": _STR_MAP,
                            },
                        },
                    },
                },
            },
        },
    },
}

YAMLLINT = YamlLintConfig(
    "extends: default\n"
    "rules:\n"
    "  line-length: {max: 200}\n"
    "  document-start: disable\n"
    "  comments: {min-spaces-from-content: 1}\n"
    "  comments-indentation: disable\n"
    "  indentation: {spaces: consistent, indent-sequences: whatever}\n"
    "  truthy: {check-keys: false}\n"
)


def validate(obj: dict[str, Any]) -> None:
    """Strict schema validation of one object (unknown fields are errors)."""
    crd = CRD_SCHEMAS.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if crd is not None:
        jsonschema.validate(obj, crd)
        return
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def lint(text: str, what: str) -> None:
    problems = [
        p for p in linter.run(text, YAMLLINT) if p.level == "error" or p.rule == "key-duplicates"
    ]
    assert not problems, f"{what}: " + "; ".join(f"line {p.line}: {p.desc}" for p in problems)
