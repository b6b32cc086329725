"""solrl: Sol-RL (FP4 explore, BF16 train) RL post-training of text-to-image flow models.

The import namespace maps the repository's top-level folders: ``solrl.flows``
(``flows/``), ``solrl.stages`` (``stages/``), ``solrl.storage`` (``storage/``)
and ``solrl.configs`` (``configs/``).
"""

__version__ = "0.1.0"
