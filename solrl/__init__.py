"""solrl: Sol-RL (FP4 explore, BF16 train) RL post-training of text-to-image flow models.

The import namespace maps the repository's top-level folders: ``solrl.flows``
(``flows/``), ``solrl.stages`` (``stages/``), ``solrl.storage`` (``storage/``)
and ``solrl.configs`` (``configs/``).
"""

import logging

__version__ = "0.1.0"


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


# Two known, harmless messages of this torch / torchao / diffusers combination, printed at import on every
# command: diffusers looks for torchao tensor classes solrl never loads (it does not deserialize torchao
# checkpoints), and torchao registers enums with torch's pytree in a way torch 2.14 calls deprecated.
logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").addFilter(
    _DropMessages("Unable to import `torchao` Tensor objects")
)
logging.getLogger("torch.utils._pytree").addFilter(_DropMessages("is an Enum subclass and is now natively supported"))
