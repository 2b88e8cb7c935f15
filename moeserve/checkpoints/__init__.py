"""Random-weight Hugging Face checkpoints with the real per-layer shapes of published MoE models.

``shapes`` holds the shape table (values from each model's published ``config.json``), ``vocab``
builds a tokenizer whose vocabulary matches a model's ``vocab_size``, and ``writer`` writes the
checkpoint one layer at a time (``moeserve make-checkpoint``).
"""
