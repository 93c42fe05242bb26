"""Nothing reads a layout decision from an ambient scope while a step is traced: every decision
(mesh sizes, pipeline stages, sequence axes and order, gradient replicas, token split, platform,
kernels) is a field of the sharding.Layout handed to the model, the step and the pipeline
executor. While each program of benchmarks/program_hashes.py (the CPU and the H100 ones) is
traced, the ambient readers raise: the sharding scope may be read only by the logical names'
resolution (sharding/scope.py: spec, constrain, shardings) and Layout.bind, and JAX's own
ambient state (default backend, devices, abstract mesh) not at all outside that resolution."""

import inspect
import os
import sys

import jax
import pytest

import kernels
from benchmarks import program_hashes
from sharding import MeshConfig, layout as layout_module, scope
from sharding.xla import compiled
from trainer.trainer import Trainer

OURS = ("cli", "configs", "trainer", "models", "sharding", "kernels")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUR_DIRS = tuple(os.path.join(REPO, package) + os.sep for package in OURS)


class AmbientRead(AssertionError):
  """A decision read from an ambient scope while tracing."""


def _allowed(frame, ours: tuple[str, ...]) -> bool:
  """Whether the function in `frame` may read an ambient scope: anything outside `ours` (JAX's
  own lowering asks for devices), and of ours sharding/scope.py's functions (the logical names'
  resolution) and Layout.bind's wrapper."""
  code = frame.f_code
  return not code.co_filename.startswith(ours) or code.co_filename == scope.__file__ or (
      code.co_filename == layout_module.__file__ and code.co_name == "bound")


def _guarded(name: str, original, ours: tuple[str, ...]):
  def reader(*args, **kwargs):
    caller = inspect.currentframe().f_back
    if not _allowed(caller, ours):
      raise AmbientRead(f"{name} read by {caller.f_code.co_name} in"
                        f" {caller.f_code.co_filename}:{caller.f_lineno} while tracing")
    return original(*args, **kwargs)
  return reader


@pytest.fixture
def ambient_readers_raise(monkeypatch):
  """Within the fixture's `guard()`, the ambient readers raise for any caller but the allowed."""
  readers = {"sharding.scope.active": (scope, "active"),
             "sharding.scope.current": (scope, "current"),
             "jax.sharding.get_abstract_mesh": (jax.sharding, "get_abstract_mesh"),
             "jax.default_backend": (jax, "default_backend"),
             "jax.devices": (jax, "devices"), "jax.local_devices": (jax, "local_devices")}
  originals = {name: getattr(owner, attr) for name, (owner, attr) in readers.items()}

  class Guard:
    def __init__(self, ours: tuple[str, ...] = OUR_DIRS):
      self.ours = ours

    def __enter__(self):
      for name, (owner, attr) in readers.items():
        guarded = _guarded(name, originals[name], self.ours)
        monkeypatch.setattr(owner, attr, guarded)
        # Modules that imported the reader by name hold it too.
        for module_name, module in list(sys.modules.items()):
          if module_name.split(".")[0] in OURS and getattr(module, attr, None) is \
              originals[name]:
            monkeypatch.setattr(module, attr, guarded)

    def __exit__(self, *exc):
      monkeypatch.undo()

  return Guard


def _trainer(cfg, target: str) -> Trainer:
  devices = None if target == "cpu" else compiled.gpu_devices(compiled.parse_gpu_target(target))
  return Trainer(cfg, devices)


PROGRAMS = [(name, cfg, "cpu") for name, cfg in program_hashes.programs().items()] + [
    (name, cfg, "h100x8") for name, cfg in program_hashes.gpu_programs().items()] + [
    # The expert loop's region (sharding/expert_loop.py), not among the hashed programs.
    ("expert=4,data=2,dropless,ga=2", program_hashes.config(
        MeshConfig(data=2, expert=4), moe=program_hashes.MOE, microbatches=2), "cpu")]


@pytest.mark.parametrize("name, cfg, target", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_no_decision_is_read_from_an_ambient_scope(ambient_readers_raise, name, cfg, target):
  trainer = _trainer(cfg, target)  # resolving the layout reads the devices: before the guard
  state, batch = trainer.abstract_state, trainer.abstract_batch()
  with ambient_readers_raise():
    trainer.train_step.lower(state, batch)
  del name


def test_the_guard_catches_a_decision_read_while_tracing(ambient_readers_raise):
  """What the test above would fail on: kernels.attention left to choose "auto" itself reads
  JAX's default backend while tracing, and a decision reader planted among our modules (here
  this test file, counted as ours) that asks the sharding scope is caught too; the kernel the
  layout chose reads nothing."""
  name, cfg, target = PROGRAMS[0]
  trainer = _trainer(cfg, target)
  q = jax.ShapeDtypeStruct((1, 8, 2, 4), "float32")
  with trainer.scope(), ambient_readers_raise():
    with pytest.raises(AmbientRead, match="jax.default_backend read by attention"):
      jax.jit(lambda q: kernels.attention(q, q, q, impl="auto")).lower(q)
    jax.jit(lambda q: kernels.attention(q, q, q, impl="xla")).lower(q)
  planted = (*OUR_DIRS, os.path.abspath(__file__))
  with trainer.scope(), ambient_readers_raise(planted):
    with pytest.raises(AmbientRead, match="sharding.scope.active read by planted_reader"):
      jax.jit(planted_reader).lower(1.0)
  del name


def planted_reader(x):
  """A decision read from the ambient scope (the mesh's size), as the layout forbids."""
  return x * scope.active().mesh.size
