"""The head's tokens split over the pipeline stages: every stage runs the head on 1/stages of a
microbatch's tokens, in the ticks after the last position's forward (Schedule.head_ops). One
stage running it alone held the others waiting in that tick (lock step), and the 70B TP4 PP8
program charged its GEMMs, 25% of its kernel time, at every tick."""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class HeadPieces:
  """stages: the pipeline size; length: the sequence length; holder: the stage holding the last
  position (whose output is split); axis: the pipeline axis name; me: this stage's index."""

  stages: int
  length: int
  holder: int
  axis: str
  me: jax.Array

  @property
  def piece(self) -> int:
    return -(-self.length // self.stages)

  def piece_of(self, a, index):  # [b, L, ...] -> [b, piece, ...]: tokens index, index + stages..
    # Strided, not contiguous: a sequence split over `tensor` (sequence parallelism) holds an
    # equal part of every piece, so taking one moves nothing (a contiguous piece was resharded
    # over `tensor` by permutes, 12 more a tick than the pieces' own 14 at 8 stages).
    if a.ndim < 2 or a.shape[1] != self.length:
      return a
    padded = jnp.pad(a, [(0, 0), (0, self.piece * self.stages - self.length)]
                     + [(0, 0)] * (a.ndim - 2))
    a = padded.reshape(a.shape[0], self.piece, self.stages, *a.shape[2:])
    return jax.lax.dynamic_index_in_dim(a, index, axis=2, keepdims=False)

  # The pieces move by permutes from and to the holder: XLA gathered the rows of a
  # reduce-scatter's or all-gather's operand over `expert` (an auto axis in the stages).
  def others(self) -> list[int]:
    return [s for s in range(self.stages) if s != self.holder]

  def scatter(self, y):  # the holder's y [b, L, ...] -> each stage's piece [b, piece, ...]
    mine = jnp.where(self.me == self.holder, self.piece_of(y, self.holder), 0)
    for s in self.others():
      mine = mine + jax.lax.ppermute(self.piece_of(y, s), self.axis, [(self.holder, s)])
    return mine

  def gather(self, mine):  # each stage's piece -> the whole [b, L, ...] on the holder
    b, rest = mine.shape[0], mine.shape[2:]
    whole = jnp.zeros((b, self.piece, self.stages, *rest), mine.dtype)
    for s in [self.holder, *self.others()]:
      whole = whole.at[:, :, s].set(
          mine if s == self.holder else jax.lax.ppermute(mine, self.axis, [(s, self.holder)]))
    return whole.reshape(b, self.piece * self.stages, *rest)[:, :self.length]
