"""Disaggregated groups: controller, encoder, transformer and decoder on this machine."""
