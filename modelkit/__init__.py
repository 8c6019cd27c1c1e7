"""Random-weight models of the real architectures, built locally (nothing is downloaded).

* :mod:`modelkit.tiny` - tiny models of every pipeline, for the tests, the demo and the CPU
  benchmarks: ``build_task(out, task)``, ``build_all(out)``; ``python -m modelkit.tiny``.
* :mod:`modelkit.real` - the published sizes (Wan2.1 T2V 1.3B / 14B, I2V 14B, Qwen-Image,
  Qwen-Image-Edit-2511; text encoders as 2-layer stand-ins or, with ``text_encoders="full"``,
  at their published sizes) for the GPU benchmarks: ``build(arch, dest)``;
  ``python -m modelkit.real``.

Their parts: :mod:`modelkit.tokenizers` (tokenizers trained on a few sentences) and
:mod:`modelkit.components` (seeded modules and the published schedulers). Above the workers in
the layering: it reads the Qwen prompt templates and the synthetic pipeline's config from
``workers.models``.
"""
