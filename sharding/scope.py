"""The one sharding scope (mesh, rules, ZeRO stage) and what reads it: the logical names'
resolution into PartitionSpecs, constrain() and shardings. It holds no decision of the layout
(those are the Layout's fields, handed to whoever needs one); "context" names the context-parallel
axis only."""

import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import mesh_sizes
from sharding.rules import (DEFAULT_RULES, Rules, entry_axes, logical_to_spec, role_rules,
                            spec_entry)


@dataclasses.dataclass(frozen=True)
class _Scope:
  mesh: Mesh
  rules: Rules
  zero_stage: int
  recorded: list | None  # (shape, names, spec) of every constrain(), when recording
  excluded: frozenset = frozenset()  # axes taken by an enclosing vmap(spmd_axis_name=...)


_CURRENT: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "meshtron_sharding", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules = DEFAULT_RULES, zero_stage: int = 0):
  """Within this context, names resolve on `mesh` with `rules` (and the ZeRO stage's views)."""
  token = _CURRENT.set(_Scope(mesh, tuple(rules), zero_stage, None))
  try:
    yield
  finally:
    _CURRENT.reset(token)


@contextlib.contextmanager
def record_constraints():
  """Collects (shape, names, spec) of each activation constraint traced inside."""
  outer = current()
  recorded: list = []
  token = _CURRENT.set(dataclasses.replace(outer, recorded=recorded))
  try:
    yield recorded
  finally:
    _CURRENT.reset(token)


def active() -> _Scope | None:
  """The open sharding scope, or None outside every `use_rules`: what the logical-name
  resolution below reads (every read goes through here); a layout decision never does."""
  return _CURRENT.get()


@contextlib.contextmanager
def excluding(axes: tuple[str, ...]):
  """Inside `jax.vmap(..., spmd_axis_name=axes)`: specs must not use those axes again."""
  outer = active()
  if outer is None or not axes:
    yield
    return
  token = _CURRENT.set(dataclasses.replace(outer, excluded=outer.excluded | frozenset(axes)))
  try:
    yield
  finally:
    _CURRENT.reset(token)


def current() -> _Scope:
  """The active scope; raises if no `use_rules` scope is open."""
  value = active()
  if value is None:
    raise RuntimeError("no sharding scope: wrap the call in sharding.use_rules(mesh, rules)")
  return value


def spec(names: Sequence[str | None], shape: Sequence[int], what: str = "array",
         role: str = "activation") -> PartitionSpec:
  """The PartitionSpec of an array in the current context; `role` selects the ZeRO view
  ("params", "grads", "opt_state"; activations use the rules as they are)."""
  ctx = current()
  rules = role_rules(ctx.rules, role, ctx.zero_stage)
  if ctx.excluded:
    rules = tuple((name, tuple(a for a in axes if a not in ctx.excluded)) for name, axes in rules)
  return logical_to_spec(names, shape, mesh_sizes(ctx.mesh), rules, what)


def named_sharding(names: Sequence[str | None], shape: Sequence[int], what: str = "array",
                   role: str = "activation") -> NamedSharding:
  """The NamedSharding of an array with these logical dim names in the current context."""
  return NamedSharding(current().mesh, spec(names, shape, what, role))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by logical names; a no-op outside `use_rules`."""
  ctx = active()
  if ctx is None:
    return x
  resolved = spec(names, x.shape, "activation")
  if ctx.recorded is not None:
    ctx.recorded.append((tuple(x.shape), tuple(names), resolved))
  return constrain_spec(x, resolved)


def constrain_spec(x: jax.Array, resolved: PartitionSpec) -> jax.Array:
  """Constrains x to a PartitionSpec of the current mesh; a no-op outside `use_rules`. Inside a
  shard_map manual over some axes the spec names only the others (`excluding` keeps them out of
  resolved specs) and the constraint names the abstract mesh that marks them Manual."""
  if active() is None:
    return x
  abstract = jax.sharding.get_abstract_mesh()
  mesh = abstract if abstract.manual_axes else current().mesh
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, resolved))


def constrain_cotangent(x: jax.Array, names: Sequence[str | None],
                        role: str = "activation") -> jax.Array:
  """`x` unchanged; in the backward pass its cotangent constrained by logical names (a no-op
  outside `use_rules`). Where two dots read one gradient, one constraint makes XLA move it
  once for both instead of once per dot. `role="params"`: a weight's gradient, sharded as the
  weight is stored."""
  if active() is None:
    return x

  def constrained(g):
    if role == "activation":
      return constrain(g, names)
    return constrain_spec(g, spec(names, g.shape, "a weight's gradient", role))

  @jax.custom_vjp
  def identity(y):
    return y

  identity.defvjp(lambda y: (y, None), lambda _, g: (constrained(g),))
  return identity(x)


def replicated() -> NamedSharding:
  """A fully replicated sharding on the current mesh (scalars, RNG keys, metrics)."""
  return NamedSharding(current().mesh, PartitionSpec())


def is_names(x: Any) -> bool:
  """True for a leaf of a logical-names tree: a tuple of dim names."""
  return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def tree_shardings(names_tree: Any, abstract_tree: Any, role: str = "params",
                   prefix: str = "") -> Any:
  """NamedShardings for a pytree of arrays given a matching pytree of logical-name tuples."""
  def one(path, names, leaf):
    what = prefix + jax.tree_util.keystr(path, simple=True, separator="/")
    return named_sharding(names, leaf.shape, what, role)
  return jax.tree_util.tree_map_with_path(one, names_tree, abstract_tree, is_leaf=is_names)


def specs_over(names_tree: Any, tree: Any, axes: tuple[str, ...], role: str = "params") -> Any:
  """Each array's PartitionSpec in the current scope with only `axes` kept (the others' entries
  dropped): what a shard_map manual over those axes alone names (a pipeline stage's experts)."""
  def one(path, names, leaf):
    full = spec(names, leaf.shape, role + jax.tree_util.keystr(path), role)
    return PartitionSpec(*(spec_entry([a for a in entry_axes(e) if a in axes]) for e in full))
  return jax.tree_util.tree_map_with_path(one, names_tree, tree, is_leaf=is_names)


def constrain_tree(tree: Any, names_tree: Any, role: str) -> Any:
  """Constrains every array of a state-shaped tree (e.g. gradients) to its role's sharding."""
  if active() is None:
    return tree
  shardings = tree_shardings(names_tree, tree, role, prefix=f"{role}/")
  abstract = jax.sharding.get_abstract_mesh()
  if abstract.manual_axes:  # inside a shard_map, as in `constrain`
    shardings = jax.tree.map(lambda s: NamedSharding(abstract, s.spec), shardings)
  return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)
