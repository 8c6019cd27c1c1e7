"""The DiT stage's options, beside the model core: attention backends (``attention``, the
swappable kernel processors ``kernels``, the quantised kernels ``fp8_attention`` and
``sage2_attention``), FP8 matmuls and the compile cache (``dit_options``), per-request LoRA
adapters and step caches (``lora``, ``step_cache``, ``dit_requests``), and one DiT over
several GPUs (``parallel``). Each is off by default; the families apply them to their DiT.
"""
