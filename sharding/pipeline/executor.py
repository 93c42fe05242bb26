"""Pipeline parallelism inside one SPMD program: a schedule's tick table run under shard_map over
the pipeline axis, with ppermute between stages and a manual backward (jax.vjp)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from sharding.pipeline import kept_residuals, schedules as sched, stage_split, transfers
from sharding.pipeline.device_order import device_order
from sharding.pipeline.head_pieces import HeadPieces
from sharding.pipeline.reduction import per_replica_specs, reduce_sums, split_into, sum_replicas
from sharding.pipeline.shared_grads import Leaves, embedding_grads, embeddings
from sharding.pipeline.stage_fns import StageFns
from sharding.pipeline.tick_loops import scan_ticks
from sharding.scope import excluding
from sharding.shard_map import varying_over


def pipeline_grads(layout, fns: StageFns, schedule: sched.Schedule, layers, shared, data: dict,
                   present: dict | None = None, by_max=None, accum_dtype=None,
                   expert_specs=None, recompute=True, reduced_specs=None, grad_parts=None):
  """Runs `schedule` over the microbatches in `data` ({name: [M, b, ...]}).

  Args:
    layout: the run's sharding.Layout: its mesh, pipeline axis and gradient replica axes.
    fns: the model's pieces.
    schedule: from sharding.pipeline.schedules.make (stages = pipeline size).
    layers: {stack: stacked layer weights [L, ...]}, each L divisible by stages x virtual.
    shared: pytree of the other weights (embedding, final norm, head), replicated over stages.
    data: the microbatches {name: [M, b, ...]}, replicated over stages; their rows split over
      the data-parallel replicas.
    present: uneven stages: {stack: [stages x virtual, L / (stages x virtual)] bool}, the rows of
      each position (model order) that hold a layer (sharding/pipeline/stage_split.py); {}:
      all rows.
    by_max: (tree like `layers`, tree like `shared`) of bools: the leaves whose "gradients" are
      combined by max over microbatches and stages instead of summed (fp8 amax histories);
      None: every leaf summed.
    accum_dtype: the dtype the summed gradients are carried in over the microbatches (the
      train step's grad_accum_dtype); None: each parameter's. The by-max leaves keep theirs.
    expert_specs: under `layout.stage_expert_axes`, (tree like `layers`, tree like `shared`) of
      each weight's PartitionSpec over those axes only (the experts' weights: their experts
      dim; a stacked weight's first entry is ignored); None: none split over them.
    recompute: a backward tick runs its chunk's forward again (storing only its input); False:
      the forward tick keeps its residuals for it (sharding/pipeline/kept_residuals.py).
    reduced_specs: under ZeRO-1, a tree like `layers` of each weight's optimizer-state
      PartitionSpec over the replica axes: its gradient is reduce-scattered into those parts
      (sharding/pipeline/reduction.py) and returned split so; None: all-reduced whole.
    grad_parts: under ZeRO-2, a tree like `layers` of each weight's gradient PartitionSpec over
      the stage's automatic axes: each tick's gradients are reduce-scattered into those parts.
  Returns:
    (layer gradients like `layers`, shared gradients, loss_sum, stats, row_stats [L, ...] in
    storage order), summed over microbatches, in the parameters' dtypes.
  """
  axis = layout.pipeline_axis
  # Data-parallel replicas are manual too: each differentiates its rows of every microbatch and
  # keeps its gradient sums, reduced once after the schedule (not once per tick and weight).
  # The sequence's parts likewise (context parallelism, `Layout.stage_sequence_axes`): each
  # device runs its part of every sequence through the stages, and keeps its gradient sums.
  # And the expert devices (`Layout.stage_expert_axes`): each runs its own rows and keeps its
  # sums of the weights they share; the experts' weights stay split, each device its own.
  rows_axes = (*layout.gradient_replica_axes[0], *layout.stage_expert_axes)
  seq_axes = layout.stage_sequence_axes
  replica_axes = layout.stage_replica_axes  # (*rows_axes, *seq_axes)
  layer_specs, shared_specs = expert_specs or jax.tree.map(lambda _: PartitionSpec(),
                                                           (layers, shared))
  layer_specs = jax.tree.map(lambda s: PartitionSpec(axis, *s[1:]), layer_specs,
                             is_leaf=lambda x: isinstance(x, PartitionSpec))

  def batch_spec(a):  # [M, b, L, ...]: rows over the replicas, the sequence over its parts
    return PartitionSpec(None, rows_axes or None, *((seq_axes,) if a.ndim > 2 and seq_axes
                                                    else ()))
  to_chunks = functools.partial(device_order, schedule, layout.mesh, axis)
  grad_specs, later, parts = per_replica_specs(layer_specs, reduced_specs, by_max[0] if by_max
                                               else jax.tree.map(lambda _: False, layers),
                                               replica_axes)

  def per_device(layers, shared, data):
    with excluding((axis, *replica_axes)):
      return _run(fns, schedule, axis, replica_axes, layers, shared, data, present, by_max,
                  accum_dtype, recompute, later, grad_parts)

  mapped = jax.shard_map(
      per_device, mesh=layout.mesh, axis_names={axis, *replica_axes},
      in_specs=(layer_specs, shared_specs, jax.tree.map(batch_spec, data)),
      out_specs=(grad_specs, shared_specs, PartitionSpec(), PartitionSpec(),
                 PartitionSpec(axis)))
  layer_grads, shared_grads, loss_sum, stats, row_stats = mapped(to_chunks(layers), shared, data)
  layer_grads = sum_replicas(layer_grads, later, parts, layers, layout.mesh)
  return (to_chunks(layer_grads, inverse=True), shared_grads, loss_sum, stats,
          to_chunks(row_stats, inverse=True))


def _run(fns, schedule, axis, replica_axes, layers, shared, data, present, by_max, accum_dtype,
         recompute, later, grad_parts):
  """One device's part: a scan over the ticks of the table."""
  manual = (axis, *replica_axes)
  stages, virtual = schedule.stages, schedule.virtual
  slots, last_position = schedule.buffer_slots(), stages * virtual - 1
  table = jnp.stack([jnp.asarray(schedule.op), jnp.asarray(schedule.microbatch),
                     jnp.asarray(schedule.chunk)], axis=-1)  # [T, S, 3]
  paired = None if schedule.paired is None else jnp.asarray(schedule.paired)  # DualPipeV's F&B

  def used(k, ticks):  # the operations slot k runs in `ticks`: only those are compiled
    ops = schedule.op if k == 0 else schedule.paired[..., 0]
    return sorted({int(o) for o in np.unique(ops[ticks])})
  positions = jnp.asarray(schedule.positions())  # [virtual, stages]
  tables = schedule.messages()  # (send, receive)
  arrivals, tables = transfers.arriving(tables[1]), tuple(map(jnp.asarray, tables))
  me = jax.lax.axis_index(axis)
  local = jax.tree.map(lambda w: w.reshape(virtual, w.shape[0] // virtual, *w.shape[1:]), layers)
  # The axes each weight is split over: its own values, its gradient not summed over them.
  own = lambda w: frozenset(jax.typeof(w).manual_axis_type.varying) - {axis}
  layer_own, shared_own = jax.tree.map(own, layers), jax.tree.map(own, shared)
  # As varying values their gradients stay per replica (no implicit psum).
  local = jax.tree.map(lambda w: varying_over(w, replica_axes), local)
  first_mb = jax.tree.map(lambda a: a[0], data)
  live = stage_split.live_chunks(schedule.positions(), present or {}, local)
  # Each position's rows, static (numpy), so XLA drops its padding rows' conditionals: a forward
  # or backward runs under a switch over the positions' distinct row patterns (or one stack's
  # rows masked: stage_split.nested), the last position's backward (with the multi-token
  # prediction, which only it runs) with its own; a tick is priced at its costliest pattern.
  patterns, pattern_of = stage_split.row_patterns(present or {})
  nested = len(patterns) > 1 and stage_split.nested(patterns)
  last_rows = patterns[pattern_of[last_position] if present else 0]
  present = {k: jnp.asarray(v) for k, v in (present or {}).items()}
  act = jax.eval_shape(fns.first, shared, first_mb)
  # The head's tokens split over the stages (sharding/pipeline/head_pieces.py).
  head_ops = schedule.head_ops()  # [T, 3]: microbatch, stage, chunk; -1: none
  heads = jnp.asarray(head_ops)
  pieces = HeadPieces(stages, act.shape[1],
                      int(np.unique(head_ops[head_ops[:, 0] >= 0, 1]).item()), axis, me)
  piece_of = pieces.piece_of
  x = jax.lax.pcast(jnp.zeros(act.shape, act.dtype), manual, to="varying")  # as stages see it
  # fp8 weights quantized once per step, each chunk where it lives: ticks that quantized their
  # chunk's weights (an amax pass and a cast per weight, in the forward and again in the
  # backward's recomputation) took 5% of the 70B TP4 PP8 VP5 program's kernel time.
  quantized = None if fns.quantize is None else jax.vmap(fns.quantize, in_axes=(None, 0))(
      shared, local)
  _, _, stage_stats, row_shape = jax.eval_shape(
      fns.stage, shared, jax.tree.map(lambda w: w[0], local), x, first_mb,
      {k: v[0] for k, v in present.items()},
      jax.tree.map(lambda w: w[0], quantized))
  (_, stats_shape) = jax.eval_shape(fns.head, shared, piece_of(x, 0),
                                    jax.tree.map(lambda a: piece_of(a, 0), first_mb))
  if fns.last is not None:
    stats_shape = {**stats_shape, **jax.eval_shape(fns.last, shared, x, first_mb)[1]}
  stats_shape = {**stats_shape, **stage_stats}
  head_reads = Leaves.read_by(fns.head, shared, piece_of(x, 0),
                              jax.tree.map(lambda a: piece_of(a, 0), first_mb))
  last_reads = None if fns.last is None else Leaves.read_by(fns.last, shared, x, first_mb)
  # Every value here differs per stage (and replica): zeros too are typed as varying over the
  # manual axes, so the branches of the per-stage switch agree on their types.
  vary = lambda tree: jax.tree.map(lambda a: varying_over(a, manual), tree)
  zeros = lambda tree: vary(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree))
  buffer = vary(jnp.zeros((virtual, slots, *act.shape), act.dtype))
  # The shared weights are replicated over stages; as varying values their gradients stay
  # per stage (no implicit psum inside a branch only one stage takes) and are summed at the end.
  shared = vary(shared)
  keeping = None if recompute else kept_residuals.for_stage(  # nested patterns, no `last`
      fns.stage, patterns, vary, local, quantized, shared, x, first_mb)
  kept_count, kept_slot = schedule.kept_slots() if keeping else (0, None)  # each op's slot
  layer_max, shared_max = by_max or (jax.tree.map(lambda _: False, local),
                                     jax.tree.map(lambda _: False, shared))
  # The sums over microbatches in accum_dtype (float32 by default, as the unpipelined step and
  # Megatron's main_grad keep them: 128 bf16 additions lose the small microbatches' part).
  summed = lambda tree, by: zeros(jax.tree.map(lambda a, m: jax.ShapeDtypeStruct(
      a.shape, a.dtype if m or accum_dtype is None else accum_dtype), tree, by))
  # A stack's sums only for its live chunks (stage_split.live_chunks): chunk c adds to slot[c].
  slot = {k: jnp.asarray(np.maximum(np.cumsum(l) - 1, 0)) for k, l in live.items()}
  live_shapes = {k: jax.tree.map(lambda w, n=int(live[k].sum()): jax.ShapeDtypeStruct(
      (n, *w.shape[1:]), w.dtype), v) for k, v in local.items()}
  # Position 0's inputs: every microbatch's embedding, looked up once before the ticks. Position
  # 0's backward of microbatch m overwrites m's with its input gradient (`embedded`, from which
  # the table's gradient is taken after the ticks), unless a weight pass reads the input after.
  looked_up = vary(embeddings(fns.first, shared, data))  # [M, ...]
  weight_pass = sched.BACKWARD_WEIGHT in set(schedule.op.flat) | set(
      () if paired is None else schedule.paired[..., 0].flat)
  embedded_inputs = looked_up if weight_pass else None
  carry = dict(inputs=buffer, grads=buffer, layer_acc=summed(live_shapes, layer_max),
               shared_acc=summed(shared, shared_max),
               loss=vary(jnp.zeros((), jnp.float32)), stats=zeros(stats_shape),
               row_acc=zeros(jax.tree.map(
                   lambda s: jax.ShapeDtypeStruct((virtual, *s.shape), s.dtype), row_shape)),
               embedded=zeros(looked_up) if weight_pass else looked_up,
               kept=[] if keeping is None else [zeros(jax.ShapeDtypeStruct(
                   (kept_count, *s.shape), s.dtype)) for s in keeping.stored])

  def full(stats):  # a piece's stats among all of them (zeros for the others'), varying
    return {k: z + stats[k] if k in stats else z for k, z in zeros(stats_shape).items()}

  def varying(row_stats):  # the same type from every piece (a constant is not varying)
    return jax.tree.map(jnp.add, zeros(row_shape), row_stats)

  def add_shared(acc, reads, d):  # a piece's gradients `d` of the shared leaves it reads
    def add(a, grad_and_by_max):  # into their sums; fp8 histories: max
      g, by_max = grad_and_by_max
      return jnp.maximum(a, g) if by_max else a + g.astype(a.dtype)
    return reads.put(acc, list(zip(d, reads.take(shared_max))), add)

  def count(carry, c, loss, stats, rows):  # the loss, stats and row stats of a chunk
    return dict(carry, loss=carry["loss"] + loss,
                stats=jax.tree.map(jnp.add, carry["stats"], stats),
                row_acc=jax.tree.map(lambda a, r: a.at[c].add(r), carry["row_acc"], rows))

  def accumulate(carry, c, d_layers, d_shared, loss, stats, rows):
    carry = count(carry, c, loss, stats, rows)
    carry["layer_acc"] = {k: jax.tree.map(  # a dead chunk's zeros go to any slot
        lambda m, a, d, i=slot[k][c]: a.at[i].max(d) if m else a.at[i].add(d.astype(a.dtype)),
        layer_max[k], acc, split_into(d_layers[k], grad_parts and grad_parts[k], layer_max[k]))
        for k, acc in carry["layer_acc"].items()}
    if d_shared is not None:
      carry["shared_acc"] = add_shared(carry["shared_acc"], last_reads, d_shared)
    return carry

  def run(carry, op, m, c, ops, kept_at):
    """`op` of microbatch m, chunk c (one of `ops`; kept residuals: slot kept_at): (carry, msg)."""
    slot, position = m % slots, positions[c, me]
    mb = jax.tree.map(lambda a: a[m], data)
    chunk = jax.tree.map(lambda w: w[c], local)
    chunk_quantized = jax.tree.map(lambda w: w[c], quantized)
    pattern = jnp.asarray(pattern_of)[position]

    def by_rows(fn):  # fn(rows of a position): static, masked, or a switch over the patterns
      if len(patterns) == 1 or nested:
        return fn(stage_split.masked_rows(patterns, pattern) if nested else patterns[0])
      return jax.lax.switch(pattern, [lambda r=r: fn(r) for r in patterns])
    firsts = carry["embedded"] if embedded_inputs is None else embedded_inputs
    # The input: the embedding at position 0, else the received activation.
    x = jnp.where(position == 0, firsts[m], carry["inputs"][c, slot])
    g = carry["grads"][c, slot]
    nothing = vary(jnp.zeros(act.shape, act.dtype))
    no_loss = vary(jnp.zeros((), jnp.float32))
    none_stats, no_rows = zeros(stats_shape), zeros(row_shape)
    # Only the multi-token prediction after the last position adds to the shared gradients here.
    no_shared = None if fns.last is None else zeros(last_reads.take(shared))
    at_last = position == last_position  # of the whole pipeline
    weights = (chunk, chunk_quantized, shared)  # what a kept pullback holds of the weights

    def stage(s, p, x, rows):  # ((x, the chunk's loss), (its stats, row stats)): for jax.vjp
      y, loss, stats, row_stats = fns.stage(s, p, x, mb, rows, chunk_quantized)
      return (y, loss), (stats, row_stats)

    def vjps(wrt_params: bool, wrt_x: bool):
      """(d_chunk, d_shared or None, dx, loss, stats, row stats) of this microbatch's stage by
      recomputation; every loss it adds gets the cotangent 1. At position 0, dx is the
      embedding's output gradient: `run` keeps it, and the table's gradient is taken once after
      the ticks (a table-sized gradient per tick was added to its float32 sum at every tick,
      in lock step: 2.4 of the 70B TP4 PP8 VP5 program's 45.9 ms a tick)."""

      def middle():
        if keeping is not None:  # the loss was counted in the forward tick
          stored = [b[kept_at] for b in carry["kept"]]
          d_chunk, dx = keeping.pullback(weights, x, (mb, pattern), stored)((g, no_loss + 1))
          return d_chunk, no_shared, dx, no_loss, none_stats, no_rows
        def one(rows):
          (_, loss), pullback, (stats, row_stats) = jax.vjp(
              lambda p, x: stage(shared, p, x, rows), chunk, x, has_aux=True)
          d_chunk, dx = pullback((g, jnp.ones_like(loss)))
          return d_chunk, no_shared, dx, no_loss + loss, full(stats), varying(row_stats)
        return by_rows(one)

      def last():  # g: the head's gradient (the head ran after this microbatch's forward)
        def through_last(s, p, x):
          (y, loss), (stats, row_stats) = stage(s, p, x, last_rows)
          extra_loss, extra_stats = fns.last(s, y, mb)
          return (y, loss + extra_loss), ({**stats, **extra_stats}, row_stats)

        (_, loss), pullback, (stats, row_stats) = jax.vjp(
            lambda w, p, x: through_last(last_reads.put(shared, w), p, x),
            last_reads.take(shared), chunk, x, has_aux=True)
        d_shared, d_chunk, dx = pullback((g, jnp.ones_like(loss)))
        return d_chunk, d_shared, dx, no_loss + loss, full(stats), varying(row_stats)

      d_chunk, d_shared, dx, loss, stats, row_stats = (
          middle() if fns.last is None else jax.lax.cond(at_last, last, middle))
      if not wrt_params:
        d_chunk, d_shared = zeros(chunk), no_shared
      if not wrt_x:
        dx = nothing
      return d_chunk, d_shared, dx, loss, stats, row_stats

    # The branches return what to add to the sums, never the sums: a buffer passed through a
    # conditional is copied whole in each branch not updating it (70B TP4 PP8 VP5: 12 a tick).
    no_part = (zeros(chunk), no_shared, no_loss, none_stats, no_rows)
    no_stored = zeros(list(keeping.stored)) if keeping else []

    def idle():
      return no_part, nothing, no_stored

    def forward():  # at the last position its output goes to the head, not to a stage
      if keeping is None:
        return no_part, by_rows(lambda rows: fns.stage(shared, chunk, x, mb, rows,
                                                       chunk_quantized)[0]), no_stored
      (y, loss), (stats, rows), stored = keeping.forward(weights, x, (mb, pattern))
      return (*no_part[:2], loss, full(stats), varying(rows)), y, stored

    def backward(wrt_params=True, wrt_x=True, count_loss=True):
      d_chunk, d_shared, dx, loss, stats, row_stats = vjps(wrt_params, wrt_x)
      if not count_loss:
        loss, stats, row_stats = no_loss, none_stats, no_rows
      return (d_chunk, d_shared, loss, stats, row_stats), dx

    storing_none = lambda **how: lambda: (*backward(**how), no_stored)
    branches = {sched.IDLE: idle, sched.FORWARD: forward, sched.BACKWARD: storing_none(),
                sched.BACKWARD_INPUT: storing_none(wrt_params=False),
                sched.BACKWARD_WEIGHT: storing_none(wrt_x=False, count_loss=False)}
    if ops == [sched.IDLE, sched.BACKWARD]:  # paired_1f1b's backward slot: no conditional
      # Run on idle ticks too, masked: a switch's branch materializes its results, so each tick
      # wrote the chunk's weight gradients, concatenated the unrolled rows', and copied them,
      # before adding them to the sums (the 405B TP8 PP8 CP2 VP8 program: 1.8 s a step).
      on = op == sched.BACKWARD
      part, message = jax.tree.map(lambda a: jnp.where(on, a, 0), backward())
    else:  # only the operations this schedule uses are compiled (a backward holds a vjp)
      branch_of = jnp.zeros(5, jnp.int32).at[jnp.asarray(ops)].set(jnp.arange(len(ops)))
      part, message, stored = jax.lax.switch(branch_of[op], [branches[o] for o in ops])
      if keeping is not None and sched.FORWARD in ops:  # one slot written in place
        carry = dict(carry, kept=[b.at[kept_at].set(
            s if ops == [sched.FORWARD] else jnp.where(op == sched.FORWARD, s, b[kept_at]))
            for b, s in zip(carry["kept"], stored)])
    if {sched.BACKWARD, sched.BACKWARD_INPUT} & set(ops):  # position 0's input gradient: kept
      keep = (position == 0) & ((op == sched.BACKWARD) | (op == sched.BACKWARD_INPUT))
      kept = carry["embedded"]
      carry = dict(carry, embedded=kept.at[m].set(jnp.where(keep, message, kept[m])))
    if set(ops) <= {sched.IDLE, sched.FORWARD}:  # no gradients (paired_1f1b's forward slot):
      # adding its zeros took a pass over the chunk's sums every tick
      return (carry if keeping is None else count(carry, c, *part[2:])), message
    return accumulate(carry, c, *part), message

  def head(carry, t, y, every):
    """The head over this tick's last-position output y: each stage takes its piece of the
    tokens from the holder, differentiates the head on it, and the pieces' input gradients
    gather back into the holder's gradient buffer, which its backward reads. Under a
    conditional unless `every` tick of the loop runs it."""
    m, c = heads[t, 0], heads[t, 2]
    runs, no_loss = m >= 0, vary(jnp.zeros((), jnp.float32))
    m, c = jnp.maximum(m, 0), jnp.maximum(c, 0)

    def on_piece():
      mb = jax.tree.map(lambda a: piece_of(a[m], me), data)
      mine = pieces.scatter(y)
      loss, pullback, stats = jax.vjp(lambda w, h: fns.head(head_reads.put(shared, w), h, mb),
                                      head_reads.take(shared), mine, has_aux=True)
      d_shared, d_mine = pullback(jnp.ones_like(loss))
      dy = pieces.gather(d_mine)
      return d_shared, no_loss + loss, full(stats), dy

    def none():
      return zeros(head_reads.take(shared)), no_loss, zeros(stats_shape), zeros(act)

    d_shared, loss, stats, dy = on_piece() if every else jax.lax.cond(runs, on_piece, none)
    carry = dict(carry, loss=carry["loss"] + loss,
                 stats=jax.tree.map(jnp.add, carry["stats"], stats),
                 shared_acc=add_shared(carry["shared_acc"], head_reads, d_shared))
    slot, buffer = m % slots, carry["grads"]
    carry["grads"] = buffer.at[c, slot].set(jnp.where(runs & (me == pieces.holder), dy,
                                                      buffer[c, slot]))
    return carry

  def tick(carry, t, ticks, flags):
    ops = (used(0, ticks), used(1, ticks) if paired is not None else None)
    kept_at = (None, None) if keeping is None else jnp.asarray(kept_slot)[t, me]
    carry, message = run(carry, table[t, me, 0], table[t, me, 1], table[t, me, 2], ops[0],
                         kept_at[0])
    if flags & 2:  # the head, in loops over ticks that run it (sharding.pipeline.schedules)
      carry = head(carry, t, message, every=bool(np.all(head_ops[ticks, 0] >= 0)))
    messages = [message]
    if paired is not None:  # the backward overlapped with this tick's forward
      carry, message = run(carry, paired[t, me, 0], paired[t, me, 1], paired[t, me, 2],
                           ops[1], kept_at[1])
      messages.append(message)
    return transfers.send_and_receive(carry, messages, t, me, tables, arrivals, axis, stages,
                                      vary(jnp.zeros(act.shape, act.dtype)))

  # A loop per run of ticks that do or do not run a backward (none in the warm-up's) and the
  # head (most ticks of an interleaved schedule run none): a conditional is priced at its
  # costliest branch, as a lock-step tick waits for its slowest stage (all take the same one).
  carry = scan_ticks(carry, sched.tick_segments(sched.loop_flags(schedule)), tick)
  kept = jnp.any(positions[:, me] == 0) | weight_pass  # else `embedded` kept the embeddings
  shared_acc = embedding_grads(fns.first, shared, data, carry["embedded"], kept,
                               carry["shared_acc"], add_shared)
  # The one reduction of the step: over the replicas (layers; their rows stay on their stage),
  # over stages and replicas (the rest).
  rows_of = lambda tree: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)
  as_params = lambda tree, like: jax.tree.map(lambda a, p: a.astype(p.dtype), tree, like)
  layer_sums = reduce_sums(carry["layer_acc"], replica_axes, layer_max, layer_own, later)
  layer_sums = {k: jax.tree.map(  # the dead chunks' zeros back in place
      lambda a, w, i=np.flatnonzero(live[k]): a if len(i) == virtual else
      jnp.zeros(w.shape, a.dtype).at[i].set(a), acc, local[k])
      for k, acc in layer_sums.items()}
  # Per replica (a leading dim; summed outside, sum_replicas) or reduced, as the parameters.
  return (jax.tree.map(lambda a, p, r: a[None] if r else a.astype(p.dtype), rows_of(layer_sums),
                       layers, later),
          as_params(reduce_sums(shared_acc, manual, shared_max, shared_own), shared),
          reduce_sums(carry["loss"], manual),
          reduce_sums(carry["stats"], manual),
          rows_of(reduce_sums(carry["row_acc"], replica_axes)))
