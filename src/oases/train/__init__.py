"""Training: data and tokenizer (``data``), the per-rank loop (``loop``), rank start-up
(``launch``).

Submodules are imported where used, so ``import oases.train`` stays light.
"""
