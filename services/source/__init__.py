"""The source side of a move: readiness and the journaled cut up to the flip (spec §7.3-§7.5, §7.13)."""
