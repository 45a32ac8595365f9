"""Helpers a user of the layers may call: the largest token magnitude a layer accepts, the row-wise maximum kernel,
and the collectives its DDP path uses. Where each concern lives: validation ``softvq._checks``, distances
``softvq._kernels``, dtype policy ``softvq._precision``, torch.distributed helpers ``softvq._collectives``; the layers'
mechanisms (temperature, EMA, restarts) are the modules of :mod:`softvq.parts`."""

from softvq._checks import max_token_magnitude
from softvq._collectives import all_reduce_sum, pick_tokens
from softvq._kernels import max_rows

__all__ = ["all_reduce_sum", "max_rows", "max_token_magnitude", "pick_tokens"]
