"""Multi-process start-up and peer loss, each ending every process in one line.

Start-up: JAX's own start-up timeout ends in a native abort dump that says nothing about who is
missing, so a watchdog fires first (jax.distributed gets the user's timeout plus a margin). With
an explicit coordinator, a roll call counts the processes that started: process 0 listens on the
coordinator's port + 1 and each other process connects and sends its index. A probe ends the
start-up early (coordinator_probe_s, 60 s) when it cannot succeed at all: another process finds
nothing answering at the coordinator, or process 0 hears from no other process.

Peer loss: JAX notices a dead process only after its heartbeat timeout, and then aborts the
survivors natively (a C++ check-failure dump and SIGABRT). So the roll-call connections stay
open for the whole run, and each side sends a byte a second. A process that dies has its end
closed by the kernel, however it died: the other side prints one line and exits at once. A host
that vanishes sends nothing: the other side ends after 3/4 of the heartbeat timeout, before JAX's
abort. A process that ends normally says so first ("bye"), and its peers stop watching it.

Under SLURM and Open MPI the coordinator is resolved by trainer.process.distributed, so the same
links exist there. All of this is best effort: if port + 1 is taken, or the coordinator could not
be resolved, there is no roll call and no link, and the start-up line gives the expected count
alone.
"""

import os
import selectors
import socket
import sys
import threading
import time

BEAT, BYE = b".", b"!"
# Every line that tells a lost peer says this (trainer.process.stderr_filter looks for it).
LOSS_TOLD = "the run cannot go on without it"
_ending = threading.Lock()


def end(line: str) -> None:
  """Prints `line` as the process's one error line and exits at once (never returns). The first
  thread to get here speaks; another (the main thread's own error about the same loss) waits
  for the exit."""
  _ending.acquire()
  print(f"meshtron: error: {line}", file=sys.stderr, flush=True)
  os._exit(1)


class JoinWatch:
  """Started before jax.distributed.initialize, `joined()` after it returns, `finished()` when
  this process's work ended normally."""

  def __init__(self, coordinator: str, process_id, expected, timeout_s: int,
               silence_s: float = 22.5, probe_s: float = 60, launcher: str | None = None):
    self.process_id, self.expected, self.timeout_s = process_id, expected, timeout_s
    # Where the coordinator's address came from, for the hints of the start-up lines.
    self.named_by = {"slurm": "the step's first node (SLURM_STEP_NODELIST)",
                     "openmpi": "Open MPI's launcher address"}.get(launcher, "--coordinator")
    self.coordinator, self.silence_s = coordinator, silence_s
    self.probe_s = probe_s if 0 < probe_s < timeout_s else 0  # else: the timeout says it
    self.seen = {process_id}
    self.listening = self.answered = False
    self.links: dict[int, socket.socket] = {}  # the peer's index (process 0's: 0) -> socket
    self._links_lock = threading.Lock()
    self._done = threading.Event()  # the start-up completed
    self._finished = threading.Event()  # this process ends normally: losses no longer matter
    if coordinator and isinstance(process_id, int):
      host, _, port = coordinator.rpartition(":")
      target = self._listen if process_id == 0 else self._report
      threading.Thread(target=target, args=(host, int(port) + 1), daemon=True).start()
    threading.Thread(target=self._watchdog, daemon=True, name="meshtron-join-watch").start()

  def joined(self) -> None:
    self._done.set()
    threading.Thread(target=self._watch_peers, daemon=True, name="meshtron-peer-watch").start()

  def finished(self) -> None:
    """Tells every linked peer this process ended normally, so its exit is not a loss."""
    self._finished.set()
    with self._links_lock:
      for conn in self.links.values():
        try:
          conn.sendall(BYE)
        except OSError:
          pass

  def _add(self, peer: int, conn: socket.socket) -> None:
    with self._links_lock:
      self.links[peer] = conn

  def _listen(self, host: str, port: int) -> None:
    try:
      server = socket.create_server(("", port))
    except OSError:
      return  # the port is taken: no count, no link
    self.listening = True
    server.settimeout(0.5)
    with server:
      while not self._finished.is_set():  # late reporters still link after the start-up
        try:
          conn, _ = server.accept()
          conn.settimeout(2)
          data = conn.recv(32).decode(errors="replace").split("\n")[0].strip()
        except OSError:
          continue
        if data.isdigit():
          self.seen.add(int(data))
          conn.settimeout(None)
          self._add(int(data), conn)
        else:
          conn.close()

  def _report(self, host: str, port: int) -> None:
    started, coordinator_up, resolved = time.monotonic(), False, True
    while not self._finished.is_set():
      try:
        conn = socket.create_connection((host, port), timeout=2)
        conn.sendall(f"{self.process_id}\n".encode())
      except OSError as e:
        if self._done.is_set():
          return  # joined without a roll call (its port was taken): no link
        resolved = not isinstance(e, socket.gaierror)
        coordinator_up = coordinator_up or _answers(host, port - 1)
        if (self.probe_s and not coordinator_up
            and time.monotonic() - started > self.probe_s):
          what = ("cannot be resolved" if not resolved else "accepts no connection")
          end(f"the coordinator {self.coordinator} {what} after {self.probe_s:.0f} s (this is"
              f" process {self.process_id}); check that process 0 was started and that"
              f" {self.named_by} is its host, or raise"
              " --config.distributed.coordinator_probe_s")
        time.sleep(0.5)
        continue
      conn.settimeout(None)
      self.answered = True
      self._add(0, conn)
      return

  def _watch_peers(self) -> None:
    """Beats once a second to every link and ends this process when one is lost."""
    selector = selectors.DefaultSelector()
    watched, heard, bye = set(), {}, set()
    last_beat = 0.0
    while not self._finished.is_set():
      with self._links_lock:
        for peer, conn in self.links.items():
          if peer not in watched:
            selector.register(conn, selectors.EVENT_READ, peer)
            watched.add(peer)
            heard[peer] = time.monotonic()
      now = time.monotonic()
      if now - last_beat >= 1.0:
        last_beat = now
        for peer in watched - bye:
          try:
            self.links[peer].sendall(BEAT)
          except OSError:
            pass  # a closed link shows as end-of-file below
      for key, _ in selector.select(timeout=0.5) if watched - bye else []:
        peer = key.data
        try:
          data = key.fileobj.recv(4096)
        except OSError:
          data = b""
        if BYE in data:
          bye.add(peer)
          selector.unregister(key.fileobj)
        elif not data and not self._finished.is_set():
          end(self._loss(peer, "stopped: its connection closed"))
        else:
          heard[peer] = time.monotonic()
      if not watched - bye:
        time.sleep(0.5)
      for peer in watched - bye:
        if time.monotonic() - heard[peer] > self.silence_s and not self._finished.is_set():
          end(self._loss(peer, f"sent nothing for {self.silence_s:.0f} s (its host may be down)"))

  def _loss(self, peer: int, what: str) -> str:
    who = (f"process 0 (the coordinator, {self.coordinator})" if peer == 0
           else f"process {peer} of {self.expected}")
    return (f"{who} {what}; this is process {self.process_id}, ending too: {LOSS_TOLD}."
            " Find why in that process's log, then rerun the same command on every"
            " host: it resumes from the last checkpoint")

  def message(self) -> str:
    if self.process_id == 0 and self.listening:
      missing = sorted(set(range(int(self.expected))) - self.seen) if str(
          self.expected).isdigit() else []
      count = (f"{len(self.seen)} of {self.expected} processes started"
               + (f" (missing: {', '.join(map(str, missing))})" if missing else ""))
    elif self.process_id != 0 and self.coordinator:
      count = (f"process 0 {'is up' if self.answered else 'never answered'}; not all"
               f" {self.expected} processes joined")
    else:
      count = f"not all {self.expected} processes joined"
    return (f"{count} within {self.timeout_s} s (this is process {self.process_id}, coordinator"
            f" {self.coordinator or 'from the launcher'}); check that every process was started"
            " and can reach the coordinator, or raise"
            " --config.distributed.initialization_timeout_s")

  def _watchdog(self) -> None:
    if self.probe_s and self.process_id == 0 and not self._done.wait(self.probe_s):
      if self.listening and len(self.seen) == 1:  # no other process reached this one at all
        end(f"no other process reached the coordinator {self.coordinator} within"
            f" {self.probe_s:.0f} s (this is process 0, expecting {self.expected}); check that"
            f" the others were started with the coordinator of {self.named_by}, or raise"
            " --config.distributed.coordinator_probe_s")
    waited = self.probe_s if self.process_id == 0 else 0
    if not self._done.wait(self.timeout_s - waited):
      end(self.message())


def _answers(host: str, port: int) -> bool:
  """Whether anything accepts a TCP connection at host:port (JAX's coordination service)."""
  try:
    socket.create_connection((host, port), timeout=2).close()
    return True
  except OSError:
    return False
