"""The endpoints of a running stack, as written to ``.hostmove/stack.json``."""

from __future__ import annotations

import msgspec


class StackInfo(msgspec.Struct, frozen=True):
    nats_url: str
    nats_monitor_url: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    s3_region: str = "us-east-1"
    root: str = ""
    nats_pid: int = 0
    weed_pid: int = 0
    mode: str = "local"  # "local" (pip-installed binaries) or "containers" (testcontainers)
    credentials: str = ""
    """The operator's role file (``<root>/credentials/admin.json``: the NATS admin nkey and the S3 admin key)."""
    stream_replicas: int = 1
    """The streams' replica count on this stack: 1 on one NATS server, the node count on a cluster (``nats_url``
    then lists every node, comma-separated; issue 19 item 4)."""

    def __repr__(self) -> str:  # never print the secret
        return f"StackInfo(nats={self.nats_url}, s3={self.s3_endpoint}, mode={self.mode})"
