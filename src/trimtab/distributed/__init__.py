"""Parallelism under torchrun, in one package; model code stays single-device.

group.py       rank 0 speaks for the job; host numbers agreed over ranks
mesh.py        the device mesh: data-parallel replicas x tensor-parallel ranks
tensor.py      tensor + sequence parallelism applied to a Transformer (DTensor plans)
splits.py      which model settings split over tp / ep ranks (config checks, no torch.distributed)
parallel.py    Parallel: the trainer's view (wrapping, the step's collectives)
checkpoint.py  sharded checkpoints (DCP), resharded on load
"""

from trimtab.distributed.group import PeerOutOfMemory, all_gather_floats, all_max, broadcast_object, is_main, rank
from trimtab.distributed.parallel import Parallel

__all__ = ["Parallel", "PeerOutOfMemory", "all_gather_floats", "all_max", "broadcast_object", "is_main", "rank"]
