"""Training recipe of the bundled default model (``moe_runtime/assets/tiny-moe``).

A small Qwen3-MoE is trained on a multi-domain corpus so that its routing behaves like a real
MoE's (MoE-Infinity §3.1): experts specialise by domain, a request reuses a skewed subset of
experts, and activations are correlated across layers. A random-init model has none of this.

Modules, one job each:

- :mod:`~moeserve.train.corpus` — domain documents from ``../shared/data`` and the Python
  stdlib, the train / held-out split, and the overlap check against the benchmark prompts.
- :mod:`~moeserve.train.tokenizer` — byte-level BPE training and the tokenizer files.
- :mod:`~moeserve.train.shape` — the model shape, training settings and the parameter split.
- :mod:`~moeserve.train.trainer` — the seeded training loop and checkpoint writer.
- :mod:`~moeserve.train.routing_analysis` — routing statistics (trained vs random init).
- :mod:`~moeserve.train.model_card` — ``docs/model-card.md`` (analysis run + markdown);
  :mod:`~moeserve.train.card_figures` — its figures.

``transformers`` is an optional dependency (the ``train`` extra); only this package imports it.
"""
