"""The door: the operator HTTP API for move requests, cut, abort and status (spec §7.1, §12)."""
