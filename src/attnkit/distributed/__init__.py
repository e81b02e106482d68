"""Context parallelism: exact attention over a sequence split across the ranks of a
``torch.distributed`` process group (gloo on CPUs, NCCL on GPUs).

``import attnkit`` never imports this package (nor ``torch.distributed``); import it
as ``attnkit.distributed`` when you need it.
"""

from .layout import plan, shard, unshard, zigzag_shard, zigzag_unshard
from .ring import ring_attention

__all__ = ["ring_attention", "shard", "unshard", "zigzag_shard", "zigzag_unshard", "plan"]
