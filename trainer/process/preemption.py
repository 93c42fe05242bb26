"""Preemption: signals set a flag the loop reads every step; all processes agree on the step."""

import os
import signal
import sys

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from trainer import config_checks


class StopRequests:
  """Installs handlers for `signal_names` (e.g. "SIGTERM,SIGUSR1") until `close()`."""

  def __init__(self, signal_names: str):
    self.requested = None  # name of the signal received, if any
    self._previous = {}
    for number in config_checks.preemption_signals(signal_names):
      self._previous[number] = signal.signal(number, self._handle)

  def _handle(self, number, frame):
    del frame
    name = signal.Signals(number).name
    if number == signal.SIGINT and self.requested is not None:
      # A second Ctrl-C: the user wants out now, not after the save.
      print("meshtron: error: interrupted again: stopped without saving (the last committed"
            " checkpoint is kept)", file=sys.stderr, flush=True)
      os._exit(130)
    self.requested = name
    logging.warning("%s received: finishing this step, then saving a checkpoint%s", name,
                    " (Ctrl-C again to stop at once without saving)"
                    if number == signal.SIGINT else "")

  def should_stop(self) -> bool:
    """True on every process as soon as any process got a signal. One tiny all-gather per step
    when there are several processes, so no process waits forever in a collective."""
    local = self.requested is not None
    if jax.process_count() == 1:
      return local
    return bool(np.any(multihost_utils.process_allgather(np.int32(local))))

  def close(self) -> None:
    for number, handler in self._previous.items():
      signal.signal(number, handler)
