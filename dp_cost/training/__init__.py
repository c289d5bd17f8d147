"""The trainers' classes: the machinery they share (base.py), the non-private baseline
(standard.py), Opacus' DP trainers (opacus_trainers.py) and Flash Clipping's (flash_trainer.py).
The registry users read is ``trainers.py`` at the top level."""
