"""Twins of the real servers for the simulation, held to the same contract tests (ARCHITECTURE §7)."""
