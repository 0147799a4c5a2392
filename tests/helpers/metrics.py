"""The worker's Prometheus endpoint as a test reads it: the samples scraped, a sum over labels."""

from __future__ import annotations

import re
import urllib.request

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    with _opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            samples.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return samples


def value(samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` (with or without a ``_total`` suffix) matching ``labels``."""
    return sum(
        v
        for n, lab, v in samples
        if n in (name, name + "_total") and all(lab.get(k) == want for k, want in labels.items())
    )
