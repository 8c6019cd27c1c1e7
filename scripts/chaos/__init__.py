"""Soaks, chaos and the ring protocol's model check."""
