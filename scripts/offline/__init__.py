"""The offline bundle for air-gapped machines: build it, install it."""
