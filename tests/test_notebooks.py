"""Every notebook in notebooks/ runs top to bottom without errors, on small settings.

Each runs in its own ipykernel (nbclient), which sets its own 8 fake CPU devices before importing
JAX; MESHTRON_NOTEBOOK_SMALL=1 shortens the training and the layout list. Budget: all notebooks
together under 3 minutes on the 2-core machine (each prints its time; run with -s to see it).
"""

import glob
import os
import time
from queue import Empty

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
from jupyter_client.asynchronous import AsyncKernelClient  # noqa: E402  (nbclient's own)
from jupyter_client.channels import AsyncZMQSocketChannel  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from traitlets import Type  # noqa: E402


class SlicedPollChannel(AsyncZMQSocketChannel):
  """A kernel channel whose waits poll in slices of at most a second. pyzmq's asyncio poll can
  miss the edge-triggered wake-up of a message that has arrived and see it only when its timeout
  ends (zeromq/pyzmq#1558): nbclient waits for a cell's reply with the cell's whole timeout, so
  memory_planner.ipynb's widget cell (its reply among some hundred widget messages) sat 300 s,
  then passed: in 2 of 3 full-suite runs of 2026-11-29, in the first of 2026-12-01, and in 1 of
  4 runs of the notebook alone beside a benchmark's compiles, where nbclient's log had the
  kernel's reply 0.001 s after the cell's last message and the next cell 300 s later. Each new
  poll checks the socket at once."""

  async def get_msg(self, timeout=None):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      left = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
      if await self.socket.poll(int(min(1.0, left) * 1000)):
        return await self._recv()
      if deadline is not None and time.monotonic() >= deadline:
        raise Empty


class SlicedPollClient(AsyncKernelClient):
  shell_channel_class = Type(SlicedPollChannel)
  iopub_channel_class = Type(SlicedPollChannel)


class SlicedPollKernelManager(AsyncKernelManager):
  client_factory = Type(SlicedPollClient)

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
PATHS = sorted(glob.glob(os.path.join(NOTEBOOKS, "*.ipynb")))
EXPECTED = {"quickstart.ipynb", "memory_planner.ipynb", "parallelism_tour.ipynb"}


def _missed_wakeup(channel_class, patience_s: float):
  """A reply that arrives while a channel polls for it, whose socket's edge-triggered event is
  consumed by someone reading zmq.EVENTS before the poll's reader sees it: the message, or None
  if the channel does not return it within `patience_s` (its own timeout is 60 s)."""
  import asyncio

  import zmq
  import zmq.asyncio
  from jupyter_client.session import Session

  async def scenario():
    context = zmq.asyncio.Context()
    receiver = context.socket(zmq.PAIR)
    port = receiver.bind_to_random_port("tcp://127.0.0.1")
    sender = zmq.Context().socket(zmq.PAIR)
    sender.connect(f"tcp://127.0.0.1:{port}")
    session = Session()
    channel = channel_class(receiver, session)
    await asyncio.sleep(0.2)  # connected
    waiting = asyncio.ensure_future(channel.get_msg(timeout=60))
    await asyncio.sleep(0.1)  # the poll now waits on the socket's file descriptor
    session.send(sender, "execute_reply", {"status": "ok"})
    time.sleep(0.1)  # the reply arrives while the event loop is busy
    zmq.Socket.shadow(receiver.underlying).get(zmq.EVENTS)  # the edge is consumed
    try:
      return await asyncio.wait_for(waiting, patience_s)
    except asyncio.TimeoutError:
      return None
    finally:
      sender.close(linger=0)
      receiver.close(linger=0)

  return asyncio.run(scenario())


def test_kernel_channels_poll_in_slices_so_a_missed_wakeup_costs_a_second():
  """The missed wake-up SlicedPollChannel works around: jupyter_client's own channel does not
  return the reply within 10 s (it would at its 60 s timeout); the sliced one does."""
  assert _missed_wakeup(AsyncZMQSocketChannel, 10) is None
  reply = _missed_wakeup(SlicedPollChannel, 10)
  assert reply["msg_type"] == "execute_reply" and reply["content"] == {"status": "ok"}


def test_all_expected_notebooks_exist():
  assert EXPECTED <= {os.path.basename(p) for p in PATHS}


@pytest.mark.parametrize("path", PATHS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
  monkeypatch.setenv("MESHTRON_NOTEBOOK_SMALL", "1")
  nb = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   kernel_manager_class=SlicedPollKernelManager,
                                   resources={"metadata": {"path": NOTEBOOKS}})
  client.execute()  # raises CellExecutionError (with the cell and traceback) on any error
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
  # Measured on the 2-core machine (quiet): see the report of issue [14]. Not asserted: the
  # machine is shared, and a wall-clock bound would make this test flaky.
  print(f"{os.path.basename(path)}: {time.perf_counter() - start:.1f} s")
