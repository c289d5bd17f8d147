"""The trainers' classes: the machinery they share (base.py), the non-private baseline
(standard.py), Opacus' DP trainers (opacus_trainers.py) and Flash Clipping's (flash_trainer.py).
Their registry, and make_trainer, is registry.py (re-exported by the top-level ``trainers.py``)."""
