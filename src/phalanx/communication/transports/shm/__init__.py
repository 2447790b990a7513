"""The same-machine shared-memory transport."""
