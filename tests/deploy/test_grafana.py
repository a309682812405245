"""deploy/grafana/edgecore.json charts what the nodes export, under the names they export it."""

import json
import re
from pathlib import Path

from edgecore.core.metrics import CoreMetrics
from edgecore.edge.metrics import EdgeMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "edgecore.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> tuple[dict[str, str], set[str]]:
    """Series names a Prometheus scrape holds (counter `_total`, histogram `_bucket` ...) -> family."""
    series, families = {}, set()
    for metrics in (EdgeMetrics(), CoreMetrics()):
        for family in metrics.registry.collect():
            families.add(family.name)
            for suffix in SUFFIXES[family.type]:
                series[family.name + suffix] = family.name
    return series, families


def test_every_query_names_an_exported_series_and_every_family_is_charted():
    dash = json.loads(DASHBOARD.read_text())
    series, families = exported()
    charted = set()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"edgecore:[a-z0-9_:]+", target["expr"])
            assert names, target["expr"]
            for name in names:
                assert name in series, f"{panel['title']}: {name} is not exported by edge/ or core/metrics.py"
                charted.add(series[name])
            assert 'namespace="$namespace"' in target["expr"]
            assert 'service=~"$edge"' in target["expr"] or 'service=~"$core"' in target["expr"]
    assert charted == families, families - charted
    for var in dash["templating"]["list"][1:]:
        assert all(n in series for n in re.findall(r"edgecore:[a-z0-9_:]+", var["query"]["query"]))


def test_layout_ids_and_grid():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "edgecore"
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        for dx in range(g["w"]):
            for dy in range(g["h"]):
                assert (g["x"] + dx, g["y"] + dy) not in cells, p["title"]
                cells.add((g["x"] + dx, g["y"] + dy))
