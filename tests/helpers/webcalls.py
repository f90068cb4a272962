"""Small HTTP calls the service tests make: a free port, a JSON GET and POST, a ``/metrics`` scrape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kernel.ports import free_port as free_port  # the one free-port helper, re-exported for the service tests


def get_json(port: int, path: str, timeout_s: float = 3.0) -> tuple[int, dict[str, Any]]:
    """``(status, JSON body)``; ``(0, {})`` when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


def post_json(port: int, path: str, body: dict[str, Any], *, token: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` of the service on ``port``, parsed by the Prometheus text parser: each sample as
    ``name{label=value,...}`` (labels sorted) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain"), resp.headers
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out
