"""A lost peer is told in one line: meshtron's, not also the JAX coordination agent's.

When a peer of a multi-process run dies, two things in each survivor notice at once: meshtron's
peer link (trainer.process.join_watch), which prints one line that names the lost process and
says what to do, and JAX's C++ coordination agent, which logs its own gRPC view of the same loss
("Polled an error from coordination service", "Socket closed", the task it lost). Whichever is
first, the user would read two accounts of one event, the native one saying nothing useful.

So a multi-process run's stderr goes through this filter, a small process of its own (a thread
in the trainer would die with it and lose a native crash dump): it passes everything through at
once, but holds the agent's peer-loss lines back for HOLD_S seconds. If meshtron's own line
about a lost peer comes within that time, the held lines (and any later ones) are dropped: the
loss has been told. Otherwise they are printed as they were, so nothing the agent says is
hidden unless meshtron told the same loss. The filter ignores SIGINT and SIGTERM and ends when
the trainer's end of the pipe closes (every writer gone), so it never outlives the output it
forwards. A terminal is left as it is (a pipe would end the live progress bar): multi-host
runs write their stderr to logs (SLURM's, a pod's), and that is where the filter works.
"""

import os
import re
import select
import signal
import subprocess
import sys
import time

from trainer.process.join_watch import LOSS_TOLD

HOLD_S = 5.0
# The coordination agent's lines about a task (or the service) it lost: the error poller's,
# the heartbeat's, the preemption barrier's, the client's fatal "Terminating process" (it exits
# at once, so it may be the last line), and gRPC's wording of the closed connection they quote
# on lines of their own.
PEER_LOSS = re.compile(rb"coordination_service_agent\.cc|coordination_service\.cc"
                       rb"|preemption_sync_manager\.cc|CoordinationServiceError"
                       rb"|JAX distributed service detected fatal errors|Failed to send RPC"
                       rb"|Additional GRPC error information|Error received from peer"
                       rb"|Socket closed|Polled an error|Connection reset by peer")
MESHTRON_ERROR, LOSS_WORDS = b"meshtron: error: ", LOSS_TOLD.encode()  # meshtron's loss line


def start() -> None:
  """Routes this process's stderr (file descriptor 2, so native logs too) through the filter,
  unless it is a terminal."""
  if os.isatty(2):
    return
  read_end, write_end = os.pipe()
  subprocess.Popen([sys.executable, "-m", __name__], stdin=read_end, stdout=2, stderr=2,
                   close_fds=True)
  os.close(read_end)
  sys.stderr.flush()
  os.dup2(write_end, 2)
  os.close(write_end)


class Filter:
  """Lines in, lines out: `feed` a line, `tick` with the time, `end` at end of input."""

  def __init__(self, write):
    self.write, self.held, self.told = write, [], False

  def feed(self, line: bytes, now: float) -> None:
    if line.startswith(MESHTRON_ERROR) and LOSS_WORDS in line:
      self.held, self.told = [], True
      self.write(line)
    elif PEER_LOSS.search(line):
      if not self.told:
        self.held.append((now, line))
    else:
      self.write(line)

  def tick(self, now: float) -> None:
    while self.held and now - self.held[0][0] >= HOLD_S:
      self.write(self.held.pop(0)[1])

  def end(self) -> None:
    for _, line in self.held:
      self.write(line)
    self.held = []


def main() -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles these; its exit ends us
  signal.signal(signal.SIGTERM, signal.SIG_IGN)

  def write(data: bytes) -> None:
    try:
      os.write(1, data)
    except OSError:
      pass  # nobody reads the output any more: drain the input all the same

  out, pending = Filter(write), b""
  while True:
    ready, _, _ = select.select([0], [], [], 0.5)
    if ready:
      data = os.read(0, 65536)
      if not data:
        break
      *lines, pending = (pending + data).split(b"\n")
      for line in lines:
        out.feed(line + b"\n", time.monotonic())
      # A native log line comes in one write, with its newline; what is left is other output
      # (a bar's update, or Python's print, which may send its newline in a write of its
      # own): it goes now, not at the next newline.
      if pending and not PEER_LOSS.search(pending):
        out.feed(pending, time.monotonic())
        pending = b""
    out.tick(time.monotonic())
  if pending:
    out.feed(pending, time.monotonic())
  out.end()


if __name__ == "__main__":
  main()
