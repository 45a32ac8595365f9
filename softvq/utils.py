"""The documented names of the former ``softvq.utils``; validation lives in ``softvq._checks``, distances in
``softvq._kernels``, dtype policy in ``softvq._precision``, torch.distributed helpers in ``softvq._collectives``,
dead-code restarts in ``softvq._restart`` and the zero-token output in ``softvq.types``."""

from softvq._checks import max_token_magnitude
from softvq._collectives import all_reduce_sum, pick_tokens
from softvq._kernels import max_rows

__all__ = ["all_reduce_sum", "max_rows", "max_token_magnitude", "pick_tokens"]
