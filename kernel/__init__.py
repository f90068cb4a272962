"""The kernel floor: the ports (clock, randomness, blocking calls, the box-local network), the named rules,
the failpoints, the file helpers and time formatting. It imports nothing of the project but ``events/``;
every service stands on it (docs/architecture.md)."""
