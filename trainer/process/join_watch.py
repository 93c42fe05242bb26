"""A multi-process start-up that not every process joins ends in one line saying how many did.

JAX's own start-up timeout ends in a native abort dump that says nothing about who is missing, so
a watchdog fires first (jax.distributed gets the user's timeout plus a margin). With an explicit
coordinator, a best-effort roll call counts the processes that started: process 0 listens on the
coordinator's port + 1 and the others send it their index until the start-up completes. If that
port is taken (or the launcher chose the coordinator), the line gives the expected count alone.
"""

import os
import socket
import sys
import threading
import time


class JoinWatch:
  """Started before jax.distributed.initialize, `joined()` after it returns."""

  def __init__(self, coordinator: str, process_id, expected, timeout_s: int):
    self.process_id, self.expected, self.timeout_s = process_id, expected, timeout_s
    self.coordinator = coordinator
    self.seen = {process_id}
    self.listening = self.answered = False
    self._done = threading.Event()
    if coordinator and isinstance(process_id, int):
      host, _, port = coordinator.rpartition(":")
      target = self._listen if process_id == 0 else self._report
      threading.Thread(target=target, args=(host, int(port) + 1), daemon=True).start()
    threading.Thread(target=self._watchdog, daemon=True, name="meshtron-join-watch").start()

  def joined(self) -> None:
    self._done.set()

  def _listen(self, host: str, port: int) -> None:
    try:
      server = socket.create_server(("", port))
    except OSError:
      return  # the port is taken: no count
    self.listening = True
    server.settimeout(0.5)
    with server:
      while not self._done.is_set():
        try:
          conn, _ = server.accept()
        except OSError:
          continue
        with conn:
          data = conn.recv(32).decode(errors="replace").strip()
          if data.isdigit():
            self.seen.add(int(data))

  def _report(self, host: str, port: int) -> None:
    while not self._done.is_set():
      try:
        with socket.create_connection((host, port), timeout=2) as conn:
          conn.sendall(f"{self.process_id}\n".encode())
        self.answered = True
        return
      except OSError:
        time.sleep(0.5)

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
    if not self._done.wait(self.timeout_s):
      print(f"meshtron: error: {self.message()}", file=sys.stderr, flush=True)
      os._exit(1)
