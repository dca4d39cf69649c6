"""Experiment configs (ml_collections files): `base.py` and one file per comparison.

Pass a file and a size to the programs: `--config=configs/mixers.py:tiny`.
"""
