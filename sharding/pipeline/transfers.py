"""A tick's transfers between stages: each message sent by ppermute to the right or the left
(or kept, at the V's turn), and what arrives written into the receiving stage's buffers, as the
schedule's message tables (Schedule.messages) say."""

import jax
import jax.numpy as jnp
import numpy as np

from sharding.pipeline import schedules as sched


def arriving(receive_table: np.ndarray) -> list[tuple[int, int]]:
  """The (source, is_gradient) pairs that ever arrive: only those buffer writes are compiled."""
  return sorted({(src, int(g)) for src in range(receive_table.shape[2]) for g in (0, 1)
                 if np.any((receive_table[..., src, 0] == 1)
                           & (receive_table[..., src, 1] == g))})


def send_and_receive(carry: dict, messages, t, me, tables, arrivals, axis, stages, nothing):
  """`carry` with tick t's arrivals written into its "inputs" and "grads" buffers [chunk, slot,
  ...]; `tables`: (send, receive) as jnp arrays; `nothing`: zeros of a message."""
  send_table, receive_table = tables
  ring = [(i, (i + 1) % stages) for i in range(stages)]
  got = []
  for k, message in enumerate(messages):
    way = send_table[t, me, k]
    got += [jax.lax.ppermute(jnp.where(way == sched.RIGHT, message, nothing), axis, ring),
            jax.lax.ppermute(jnp.where(way == sched.LEFT, message, nothing), axis,
                             [(j, i) for i, j in ring]),
            message]  # the V's turn: to this stage's other chunk
  carry = dict(carry)
  for src, gradient in arrivals:
    here, _, chunk_to, slot_to = (receive_table[t, me, src, k] for k in range(4))
    key = "grads" if gradient else "inputs"
    sent = (here == 1) & (receive_table[t, me, src, 1] == gradient)
    # One slot written in place either way (a conditional write copied the whole buffer).
    buffer = carry[key]
    carry[key] = buffer.at[chunk_to, slot_to].set(
        jnp.where(sent, got[src], buffer[chunk_to, slot_to]))
  return carry
