"""Compiling the train step once, and again without XLA's rematerialization where it fits.

XLA:GPU's rematerialization pass recomputes instructions (GEMMs too) until its own estimate of
the program's temporaries fits its memory limit, xla_gpu_memory_limit_slop_factor percent (95 by
default) of the device's memory less the arguments. That estimate can be far above what buffer
assignment then allocates: the NeMo Llama-3.1-8B CP2 recipe's program recomputes 147
instructions and peaks at 73.15 GiB, and compiled with the limit raised it recomputes none and
peaks at the same 73.15 GiB (docs/planning.md, the anchors table). So when the first program
holds recomputed instructions, the step is compiled a second time with the limit raised, and
that program is kept if its compiled peak fits the budget the first one was planned for (95% of
the device's memory) and the step-time model predicts it at least 1% faster; else the first is
kept (the Llama-3-70B fsdp=64 candidate's second program peaked 21 GiB higher, predicted 0.02%
faster). Nothing changes where XLA recomputes nothing (CPU programs, and GPU programs with room).
"""

import time

from sharding.xla import compiled

SLOP_OPTION = "xla_gpu_memory_limit_slop_factor"
XLA_DEFAULT_SLOP = 95  # percent of device memory: XLA's default, which the first compile plans for
# Percent of device memory the second compile plans for: XLA then rematerializes nothing in the
# anchors' programs (NeMo 8B CP2, torchtitan 8B FSDP 8); its peak and predicted step decide.
RAISED_SLOP = 200
# The least predicted gain for which the second program is kept: the step-time model is a
# roofline, and the Llama-3-70B fsdp=64 candidate's second program was predicted 0.02% faster
# at 21 GiB more (74.8 of 75.2 GiB); a gain under 1% of the step does not buy memory headroom.
MIN_GAIN = 0.01


def compile_step(lowered, device_memory_bytes: int, options: dict, retry: bool = True,
                 step_seconds=None):
  """(compiled program, seconds compiling, a line on XLA's rematerialization or "").

  lowered: the train step's `jax.stages.Lowered`; device_memory_bytes: one device's memory
  (0: unknown, no second compile); options: the XLA options it was lowered with (a slop factor
  set there is the user's choice: no second compile); retry: False compiles once;
  step_seconds: a program's HLO text -> its predicted step (sharding/xla/step_time.py), where
  the GPU has a profile. The second program is kept where it fits and, when step_seconds is
  given, is predicted at least MIN_GAIN faster: a program that only holds more memory (XLA's
  schedule may trade its recomputation for nothing) is not taken."""
  start = time.perf_counter()
  first = lowered.compile()
  first_text = first.as_text()
  recomputed = compiled.rematerialized(first_text)
  if not recomputed or not retry or not device_memory_bytes or SLOP_OPTION in options:
    return first, time.perf_counter() - start, (
        f"XLA recomputes {recomputed} instructions to fit its memory limit" if recomputed else "")
  second = lowered.compile(compiler_options={SLOP_OPTION: RAISED_SLOP})
  second_text = second.as_text()
  budget = device_memory_bytes * XLA_DEFAULT_SLOP // 100
  peak, first_peak = compiled.memory_of(second)["peak"], compiled.memory_of(first)["peak"]
  gib = lambda n: f"{n / compiled.GIB:.3g} GiB"  # noqa: E731
  fits = peak <= budget
  note = (f"XLA recomputed {recomputed} instructions to fit its memory limit (peak"
          f" {gib(first_peak)}); compiled again with {SLOP_OPTION}={RAISED_SLOP}:"
          f" {compiled.rematerialized(second_text)} recomputed, peak {gib(peak)}"
          f" {'<=' if fits else '>'} {gib(budget)} ({XLA_DEFAULT_SLOP}% of the device's"
          f" {gib(device_memory_bytes)})")
  faster = True
  if fits and step_seconds is not None:
    before, after = step_seconds(first_text), step_seconds(second_text)
    faster = after < (1 - MIN_GAIN) * before
    note += (f", predicted {after * 1e3:,.1f} ms a step against {before * 1e3:,.1f} ms"
             f" ({after / before - 1:+.2%}; kept from {-MIN_GAIN:.0%})")
  kept = fits and faster
  note += ": kept" if kept else ": the first program kept"
  return (second if kept else first), time.perf_counter() - start, note
