"""solrl: Sol-RL (FP4 explore, BF16 train) RL post-training of text-to-image flow models.

The import namespace maps the repository's top-level folders: ``solrl.flows``
(``flows/``), ``solrl.stages`` (``stages/``), ``solrl.storage`` (``storage/``)
and ``solrl.configs`` (``configs/``).
"""

import logging
import os

__version__ = "0.1.0"

#: OpenMP spin count solrl sets before torch loads, unless the user chose a wait policy. libgomp's threads
#: (torch's CPU pool) busy-wait 300,000 spins by default between parallel regions, which on a shared 2-core
#: machine makes two torch processes slow each other many times over (measured in issue 10: a matmul loop
#: 1.9 s idle, 25 s beside another torch process, 4.0 s there with 10,000 spins, 1.9 s idle with them).
OPENMP_SPINCOUNT = "10000"
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPINCOUNT)


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
