"""One module per model family: its three stage adapters (encoder, transformer, decoder)
over diffusers' components: Wan2.1 (``wan``), Qwen-Image and its Edit variants (``qwen``,
with the text and image conditioning of ``qwen_encoder`` / ``qwen_text``), and the synthetic
pipeline the benchmarks measure the runtime with (``synthetic``). The family table
(:mod:`workers.models.family`) says which module serves a task; they build on the shared
core one level up and on the DiT options in :mod:`workers.models.dit`.
"""
