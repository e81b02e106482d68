"""Context parallelism: exact attention over a sequence split across the ranks of a
``torch.distributed`` process group (gloo on CPUs, NCCL on GPUs).

``import attnkit`` never imports this package (nor ``torch.distributed``); import it
as ``attnkit.distributed`` when you need it.
"""

from .ring import plan, ring_attention, shard, unshard, zigzag_shard, zigzag_unshard

__all__ = ["ring_attention", "shard", "unshard", "zigzag_shard", "zigzag_unshard", "plan"]
