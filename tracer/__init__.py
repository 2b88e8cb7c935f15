"""Request-level expert-activation tracing (MoE-Infinity §4): EAMs, the EAM collection, the
per-request recorder, trace files, and offline analysis tools.

Modules: :mod:`tracer.eam` (EAM helpers), :mod:`tracer.eamc` (collection, faiss search),
:mod:`tracer.eamc_store` (save/load), :mod:`tracer.ann` (IVF index), :mod:`tracer.recorder`
(engine-thread recorder), :mod:`tracer.trace_file` (JSON-lines traces),
:mod:`tracer.import_routing` (routing-log import), :mod:`tracer.analysis` (statistics),
:mod:`tracer.predict_eval` (prediction quality), :mod:`moeserve.bench.eamc` (benchmark),
:mod:`tracer.synth` (synthetic EAMs). Depends on numpy and faiss only; never imports
``moe_runtime``.
"""
