"""model.moe.exchange_chunks: each device's tokens sorted, exchanged and run through the experts
in chunks apart, so XLA can schedule one chunk's ragged all-to-all behind another chunk's expert
matmuls. The programs are the deviceless 8xH100 compiles of the tiny MoE; that the chunked
layouts train exactly like one device is tests/test_moe_parallel.py's LAYOUTS."""

import dataclasses
import functools
import tempfile

import pytest

from configs import moe as moe_configs
from models.config import MoEConfig
from sharding import MeshConfig
from sharding.mesh import LayoutError
from sharding.xla import compiled, hlo
from tests import parallel_harness as harness
from trainer.aot import compile_for_gpus

GROUPED_MATMUL = "grouped_matmul"  # the Pallas kernel's op name (kernels/grouped_matmul.py)


def tiny_moe(chunks: int):
  """The tiny MoE on expert=8, 2 layers (first round kept: the predicted one round)."""
  cfg = moe_configs.debug_moe()
  cfg.mesh = MeshConfig(data=1, expert=8)
  cfg.batch_size, cfg.seq_len = 16, 64
  cfg.model.num_layers = 2
  cfg.model.moe = dataclasses.replace(cfg.model.moe, keep_first_round=True,
                                      exchange_chunks=chunks)
  return cfg


@functools.lru_cache(maxsize=None)
def program(chunks: int) -> str:
  """tiny_moe(chunks)'s train step compiled for 8 H100s."""
  cfg = tiny_moe(chunks)
  with tempfile.TemporaryDirectory() as tmp:
    path = f"{tmp}/step.hlo"
    compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), hlo_path=path)
    with open(path) as f:
      return f.read()


def first_round_exchanges(text: str) -> list:
  """(ragged all-to-all start, the kernels XLA scheduled before its done) of each exchange run
  once per layer and pass: outside the later rounds' loops, which the analysis counts 0 times."""
  comps = hlo.computations(text)
  runs, _, _ = hlo.executions(comps)
  op_names = hlo.op_names(text)
  found = []
  for comp, instrs in comps.items():
    if not runs[comp]:
      continue
    for at, ins in enumerate(instrs):
      if ins.op != "ragged-all-to-all-start":
        continue
      done = next(j for j in range(at, len(instrs)) if instrs[j].op == "ragged-all-to-all-done"
                  and ins.name in hlo.operands(instrs[j]))
      found.append((ins.name, [op_names.get(i.name, i.op) for i in instrs[at + 1:done]
                               if i.op in ("fusion", "custom-call")]))
  return found


def test_a_second_chunk_puts_expert_matmuls_behind_the_exchanges():
  """One chunk: each first-round exchange (4 a layer: there and back, both transposes) waits
  alone, nothing of the experts' to run in between. Two chunks: 8, and XLA runs a chunk's
  grouped matmuls (forward, and dx or dW in the backward) while the other's are in flight."""
  exchanges = {c: first_round_exchanges(program(c)) for c in (1, 2)}
  assert len(exchanges[1]) == 4 and len(exchanges[2]) == 8
  behind = {c: [name for name, kernels in found if any(GROUPED_MATMUL in k for k in kernels)]
            for c, found in exchanges.items()}
  assert not behind[1]
  assert len(behind[2]) >= 4, exchanges[2]


def test_exchange_chunks_must_be_positive_and_divide_the_tokens():
  with pytest.raises(ValueError, match="exchange_chunks must be >= 1"):
    MoEConfig(exchange_chunks=0).validate(num_layers=2)
  moe = MoEConfig(num_experts=8, expert_mlp_dim=32, dispatch="dropless", exchange_chunks=3)
  tokens = harness.BATCH * harness.SEQ // 8
  with pytest.raises(LayoutError, match=f"exchange_chunks=3 does not divide a device's {tokens}"):
    harness.run(MeshConfig(data=1, expert=8), moe=moe)
