"""The multi-process stderr filter (trainer.process.stderr_filter): the JAX coordination agent's
lines about a lost peer are dropped only when meshtron's own line tells the same loss; every
other line passes at once, and a held line that no meshtron line follows is printed."""

import os
import subprocess
import sys
import time

from trainer.process import stderr_filter
from trainer.process.join_watch import LOSS_TOLD

AGENT = (b"E1202 14:22:10.000000  4310 coordination_service_agent.cc:289] Polled an error from"
         b" coordination service (this can be an error from this or another task).\n")
GRPC = b"UNAVAILABLE: Socket closed\n"
OURS = f"meshtron: error: process 0 (the coordinator) stopped; {LOSS_TOLD}.\n".encode()
OTHER = b"E1202 14:22:11.000000  4310 pjrt_client.cc:10] a native error of another kind\n"


def run(events):
  out = []
  f = stderr_filter.Filter(out.append)
  for now, line in events:
    f.tick(now)
    f.feed(line, now)
  f.end()
  return out


def test_the_agents_loss_lines_go_when_meshtron_tells_the_loss():
  assert run([(0, AGENT), (0, GRPC), (0.1, OTHER), (0.2, OURS), (0.3, AGENT)]) == [OTHER, OURS]


def test_loss_lines_without_meshtrons_line_are_printed():
  assert run([(0, AGENT), (0, OTHER)]) == [OTHER, AGENT]  # at the end of input
  held_too_long = run([(0, AGENT), (stderr_filter.HOLD_S + 0.1, OTHER), (9, OURS)])
  assert held_too_long == [AGENT, OTHER, OURS]


def test_another_meshtron_error_does_not_drop_them():
  other_error = b"meshtron: error: process 1: a config refusal\n"
  assert run([(0, AGENT), (0.1, other_error)]) == [other_error, AGENT]


def test_the_filter_process_forwards_everything_else_and_ends_with_its_input():
  """The real process: partial output (a progress update) passes before its newline, and the
  filter ends at end of input with the held line printed."""
  proc = subprocess.Popen([sys.executable, "-m", "trainer.process.stderr_filter"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  os.set_blocking(proc.stdout.fileno(), False)
  proc.stdin.write(AGENT + b"step 1/3\r")
  proc.stdin.flush()
  deadline, got = time.time() + 30, b""  # hang guard
  while b"step 1/3\r" not in got:
    assert time.time() < deadline, got
    got += proc.stdout.read() or b""
    time.sleep(0.05)
  assert AGENT not in got  # held
  proc.stdin.close()
  assert proc.wait(timeout=30) == 0
  got += proc.stdout.read() or b""
  assert got == b"step 1/3\r" + AGENT


def test_the_filter_process_knows_meshtrons_line_without_its_newline():
  """Python's print may write a line and its newline apart: meshtron's line still tells the
  loss, so the agent's lines after it (the order seen in a real run) are dropped."""
  proc = subprocess.Popen([sys.executable, "-m", "trainer.process.stderr_filter"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  os.write(proc.stdin.fileno(), OURS[:-1])
  time.sleep(0.3)
  os.write(proc.stdin.fileno(), b"\n" + AGENT + GRPC)
  proc.stdin.close()
  assert proc.stdout.read() == OURS
  assert proc.wait(timeout=30) == 0
