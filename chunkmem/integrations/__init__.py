"""Training loops people already use, driving chunkmem's engine (docs/integrations.md).

- :mod:`chunkmem.integrations.lightning`: ``ChunkmemStrategy``, a Lightning ``Strategy``.
- :mod:`chunkmem.integrations.hf`: ``ChunkmemTrainer``, a ``transformers.Trainer`` (and a
  mixin for its subclasses, TRL's ``SFTTrainer`` among them), which also fills a DeepSpeed
  config's ``"auto"`` values from ``TrainingArguments``.

Each module imports its framework when it is imported itself; nothing here is imported by the
engine (``tests/test_layers.py`` checks that the engine never imports the frameworks).
"""
