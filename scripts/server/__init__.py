"""The start scripts of the example groups (one machine, one group)."""
