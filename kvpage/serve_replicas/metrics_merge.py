"""Prometheus text from several replicas -> one exposition, each sample labelled with its replica.

Each replica renders its own registry (the single server's metrics, unchanged); the ingress adds
`replica="<id>"` so a scrape of the service shows every replica side by side, and a family
appears once however many replicas report it."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString


def merge(texts: Mapping[str, str]) -> str:
    """replica id -> its /metrics text."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(family.name, (family.type, family.documentation, []))
            lines.extend(
                _sample(s.name, {**s.labels, "replica": replica}, s.value) for s in family.samples
            )
    out = []
    for name, (kind, doc, lines) in families.items():
        out += [f"# HELP {name} {_escape_doc(doc)}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _sample(name: str, labels: Mapping[str, str], value: float) -> str:
    pairs = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{pairs}}} {floatToGoString(value)}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_doc(doc: str) -> str:
    return doc.replace("\\", "\\\\").replace("\n", "\\n")
