"""The executor's loops over the ticks: a scan per run of ticks of equal flags, and a scan over
the repeats of a block of runs that recurs (sharding.pipeline.schedules.tick_segments)."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def scan_ticks(carry, segments, body: Callable):
  """`carry` after every tick of `segments`. body(carry, t, ticks, flags) -> carry runs tick t
  (traced) of a run of ticks with `flags`; `ticks` (numpy) are the run's ticks over all of its
  block's repeats, from which the body takes what it compiles."""
  for start, repeats, block in segments:
    period = sum(length for _, length, _ in block)

    def one_block(carry, r, start=start, repeats=repeats, block=block, period=period):
      for offset, length, flags in block:
        first = start + offset
        ticks = (first + period * np.arange(repeats)[:, None] + np.arange(length)).ravel()
        step = lambda c, t, ticks=ticks, flags=flags: (body(c, t, ticks, flags), None)
        carry, _ = jax.lax.scan(step, carry, first + r * period + jnp.arange(length))
      return carry

    if repeats == 1:
      carry = one_block(carry, 0)
    else:
      carry, _ = jax.lax.scan(lambda c, r, f=one_block: (f(c, r), None), carry,
                              jnp.arange(repeats))
  return carry
