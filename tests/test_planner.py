"""The planner: layout strings, the search and its explanations, the CLI, and predicted
throughput against the playbook's published benchmark measurements."""

import collections
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from configs.llama import MODELS
from sharding.plan import estimate, hardware, planner
from sharding.layout import Layout
from sharding.layout_text import parse
from sharding.mesh import LayoutError
from sharding.plan.estimate import PLAYBOOK_MIXED
from tests import docs_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = hardware.PROFILES["h100"]


def test_the_interface_layout_string_parses_and_round_trips():
  """Layout strings speak the mesh's axis names; the playbook's dp/tp/pp/cp/ep are input
  aliases."""
  text = "data=4,pipeline=2,tensor=2,zero=1,mbs=4,ga=16,remat=selective,sp=1,schedule=1f1b"
  layout = parse(text)
  assert layout == Layout(data=4, tensor=2, pipeline=2, zero_stage=1, micro_batch=4,
                          microbatches=16, remat="selective", sequence_parallel=True)
  assert layout.string() == text and parse(layout.string()) == layout
  assert parse("dp=4,tp=2,pp=2,cp=1,ep=1,zero=1,mbs=4,ga=16,remat=selective,sp=1") == layout
  assert (layout.num_devices, layout.global_batch) == (16, 4 * 16 * 4)
  assert parse("fsdp=8,mbs=2").fsdp == 8


@pytest.mark.parametrize("text, message", [
    ("dp=x", "dp='x' must be a positive integer"),
    ("data=4,foo=2", "unknown layout key 'foo'"),
    ("tp", "'tp' must look like key=value"),
    ("remat=some", "remat='some' is not one of none, selective, full"),
    ("data=2,sp=1", "sequence parallelism needs tensor > 1"),
    ("pipeline=2,vpp=2", "virtual_stages=2 needs the interleaved_1f1b or paired_1f1b pipeline"
                         " schedule"),
    ("zero=4", "zero stage 4 must be 0, 1, 2 or 3"),
])
def test_malformed_layouts_are_one_line_errors(text, message):
  with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
    parse(text)


def test_divisibility_is_checked_and_explained():
  model = estimate.model_spec(MODELS["llama3_70b"])
  assert planner.divisibility_errors(model, Layout(tensor=8, pipeline=4), 4096) == []
  errors = planner.divisibility_errors(model, Layout(tensor=16, pipeline=32), 4096)
  assert "kv heads 8 not divisible by tensor=16" in errors
  assert planner.divisibility_errors(model, Layout(tensor=8, pipeline=32), 4096) == []  # uneven
  assert "80 layers for pipeline=96 x virtual stages 1: every stage needs a layer" in \
      planner.divisibility_errors(model, Layout(tensor=8, pipeline=96), 4096)
  assert planner.divisibility_errors(model, Layout(context=3), 4096) == [
      "seq 4096 not divisible by 6 (2 x context, or context with a window or Ulysses; x tensor"
      " under sequence parallelism)"]


def test_plan_ranks_fitting_layouts_and_explains_every_rejection():
  model = MODELS["playbook_8b"]
  result = planner.plan(model, 16, 4096, 2**20, PLAYBOOK_MIXED, H100)
  assert result.ranked and all(c.fits for c in result.ranked)
  speeds = [c.time.tokens_per_s_per_gpu for c in result.ranked]
  assert speeds == sorted(speeds, reverse=True)
  for c in result.ranked[:20]:
    assert c.layout.num_devices == 16 and c.layout.global_batch == 256
    assert c.memory.total <= H100.memory_bytes
  reasons = " ".join(why for _, why in result.rejected)
  assert "tensor parallelism across nodes (16 > 8 GPUs per node)" in reasons
  assert "> 80 GB" in reasons
  summary = "\n".join(planner.rejection_summary(result.rejected))
  assert "does not fit in memory" in summary
  # A layout that does not fit is never ranked, and every considered one is accounted for.
  fits = {c.layout.string() for c in result.ranked}
  assert not fits & {what for what, _ in result.rejected}


def test_plan_of_a_moe_uses_expert_parallelism():
  result = planner.plan(estimate.ESTIMATOR_MODELS["mixtral_8x7b"], 64, 4096, 2**20,
                        PLAYBOOK_MIXED, H100)
  assert any(c.layout.expert > 1 for c in result.ranked)
  assert estimate.ESTIMATOR_MODELS["mixtral_8x7b"].num_params() == pytest.approx(46.7e9, rel=0.01)


def test_plan_shards_the_optimizer_over_expert_where_data_is_1():
  """ZeRO splits over data x context x expert (sharding.rules.ZERO_AXES): with every GPU on
  `expert`, ZeRO-1 and 2 are still layouts to weigh (here all too big for 8 GPUs: rejected,
  each with its reason), and ZeRO-1 needs less optimizer memory than none."""
  mixtral = estimate.ESTIMATOR_MODELS["mixtral_8x7b"]
  result = planner.plan(mixtral, 8, 4096, 2**17, PLAYBOOK_MIXED, H100)
  weighed = [c.layout.string() for c in result.ranked] + [name for name, _ in result.rejected]
  for zero in (0, 1, 2):
    assert f"data=1,expert=8,zero={zero},mbs=1,ga=4,remat=full,sp=0,schedule=1f1b" in weighed
  memory = {z: planner.evaluate(mixtral, Layout(expert=8, zero_stage=z), 4096, PLAYBOOK_MIXED,
                                H100).memory.optimizer for z in (0, 1)}
  assert memory[1] < memory[0]


def test_plan_weighs_pipeline_with_context_by_the_all_gather_and_its_config_runs_it():
  """The default ring cannot run inside pipeline stages (sharding/resolution.py): plan weighs
  pipeline x context layouts with the all-gather instead, says so in the layout
  (cp_impl=allgather, which parses back), and the config it writes runs that impl."""
  from cli.presets import train_config
  result = planner.plan(MODELS["llama3_70b"], 64, 8192, 2**21, PLAYBOOK_MIXED, H100)
  both = [c.layout for c in result.ranked if c.layout.pipeline > 1 and c.layout.context > 1]
  assert both and all(lay.context_impl == "allgather" for lay in both)
  assert all(c.layout.context_impl == "ring" for c in result.ranked if c.layout.pipeline == 1)
  lay = both[0]
  assert lay.string().endswith(",cp_impl=allgather") and parse(lay.string()) == lay
  cfg = train_config("llama3_70b", lay, 8192)
  assert cfg.compute.context_impl == "allgather" and cfg.layout(64).context_impl == "allgather"


def test_plan_70b_on_512_gpus_searches_the_whole_space():
  """70B on 512 GPUs: tens of thousands of layouts considered, thousands ranked. How long it
  takes (issue [18]'s bound: under 5 s) is benchmarks/planner_speed.py's, not a timed test's."""
  result = planner.plan(MODELS["llama3_70b"], 512, 4096, 2**20, PLAYBOOK_MIXED, H100)
  assert result.considered > 10_000 and len(result.ranked) > 1_000


# ---- predicted throughput against the playbook's measurements ----

# The playbook's benchmarks: nanotron on 1-64 nodes of 8 H100s, seq 4096, global batch 1M tokens,
# bf16 with fp32 gradient accumulation, flash attention, no recomputation. Source: the sweep's
# results file bench_final2 (huggingface/nanotron scripts/scaling_benchmarks.py writes it; the
# rows below are read from the copy at github.com/eyao600/Rapid-LLM,
# validation_scripts/huggingface_data/bench_final2_mod_add.csv). 100 successful runs sampled
# across the file (which is sorted by throughput), leaving out pipeline runs from before the
# benchmark's pipeline fix and runs flagged with a degraded network.
# Columns: model dp tp pp grad_accum micro_batch zero tokens/s/GPU.
MEASURED = """
    1b 8 1 1 16 2 0 40149.94 | 1b 8 1 1 32 1 0 39273.41 | 1b 8 1 1 32 1 1 39005.63
    1b 4 1 2 16 4 1 38894.51 | 1b 16 1 1 8 2 1 38839.82 | 1b 4 1 2 32 2 1 38299.12
    1b 4 1 2 64 1 0 37994.77 | 1b 16 1 1 16 1 1 37698.03 | 1b 4 2 1 8 8 0 37628.15
    1b 16 1 1 16 1 0 37609.69 | 1b 8 2 1 4 8 1 37159.27 | 1b 2 1 4 128 1 1 37097.48
    1b 2 1 4 64 2 1 37078.12 | 1b 32 1 1 4 2 1 36989.97 | 1b 2 1 4 128 1 0 36909.73
    1b 2 1 4 32 4 1 36565.59 | 1b 8 1 2 32 1 1 36497.09 | 1b 8 1 2 16 2 1 36394.59
    1b 32 1 1 8 1 1 35950.88 | 1b 32 1 1 8 1 0 35367.61 | 1b 2 2 2 16 8 1 35324.73
    1b 8 1 2 8 4 1 35238.16 | 1b 2 2 2 32 4 1 35062.63 | 1b 4 1 4 64 1 1 35031.93
    1b 4 1 4 32 2 1 34816.50 | 1b 4 4 1 4 16 0 34808.51 | 1b 4 4 1 4 16 1 34511.47
    1b 1 2 4 32 8 0 34468.92 | 1b 4 4 1 8 8 0 33861.62 | 1b 4 4 1 8 8 1 33834.84
    1b 16 1 2 16 1 1 33677.07 | 1b 2 4 1 8 16 0 33597.02 | 1b 4 1 4 16 4 1 33324.06
    1b 2 4 4 64 2 1 7405.21 | 3b 2 2 4 128 1 0 7399.83 | 1b 1 8 8 32 8 0 7385.46
    3b 8 2 8 8 4 1 7366.68 | 1b 4 4 4 32 2 1 7361.37 | 1b 16 2 8 16 1 1 7314.97
    1b 1 16 4 8 32 0 7305.50 | 8b 4 4 1 16 4 1 7290.47 | 8b 4 1 4 64 1 1 7289.90
    3b 8 4 4 4 8 1 7242.09 | 3b 128 2 1 1 2 1 7233.74 | 3b 128 2 1 2 1 0 7231.49
    3b 64 1 2 1 4 1 7202.64 | 3b 4 2 4 64 1 1 7201.19 | 1b 1 32 1 8 32 0 7191.00
    8b 16 1 2 16 1 1 7186.04 | 3b 2 2 4 128 1 1 7182.38 | 3b 32 8 1 2 4 1 7165.38
    1b 4 8 1 64 1 0 7161.19 | 3b 1 4 16 32 8 0 7152.84 | 8b 4 2 1 64 1 1 7140.96
    3b 2 2 8 128 1 1 7138.57 | 8b 4 2 2 32 2 1 7077.74 | 3b 1 2 8 256 1 0 7053.14
    8b 8 2 1 32 1 1 7034.88 | 8b 2 2 2 64 2 1 7016.11 | 1b 4 16 2 2 32 1 7003.86
    3b 64 4 1 2 2 1 6998.67 | 3b 32 2 2 1 8 1 6990.32 | 3b 16 2 2 16 1 1 6978.08
    3b 32 4 1 8 1 0 6972.51 | 1b 2 8 1 128 1 0 6955.80 | 3b 1 8 8 16 16 0 6942.30
    1b 4 8 1 64 1 1 6937.18 | 8b 8 1 4 32 1 1 6918.96 | 3b 2 8 16 32 4 1 2161.95
    3b 1 4 16 256 1 0 2161.82 | 8b 128 4 1 2 1 1 2156.56 | 8b 4 16 2 2 32 1 2155.11
    8b 2 4 4 128 1 1 2154.29 | 8b 8 4 2 32 1 1 2153.52 | 8b 8 8 2 8 4 1 2136.54
    8b 16 4 2 4 4 1 2129.90 | 8b 16 16 1 4 4 0 2129.82 | 8b 1 16 4 16 16 0 2126.80
    8b 4 16 2 4 16 1 2093.32 | 8b 2 16 2 8 16 1 2091.69 | 1b 2 16 2 16 8 1 2077.75
    3b 4 16 4 4 16 1 2072.99 | 8b 16 4 2 16 1 1 2071.97 | 8b 2 8 4 32 4 1 2046.97
    8b 4 8 4 16 4 1 2036.20 | 1b 1 16 4 32 8 0 2030.94 | 1b 1 16 1 256 1 0 2005.74
    3b 8 16 2 1 32 1 2000.31 | 3b 8 4 4 32 1 1 1996.64 | 8b 1 32 1 16 16 0 1992.43
    1b 8 16 2 4 8 1 1991.31 | 1b 2 16 1 128 1 0 1989.79 | 1b 4 16 1 64 1 1 1980.88
    1b 2 16 1 128 1 1 1980.30 | 1b 16 32 1 1 16 0 1975.73 | 1b 8 16 1 32 1 1 1961.18
    3b 16 4 4 16 1 1 1943.87 | 3b 8 16 1 16 2 1 1936.06 | 80b 16 32 1 16 1 0 96.49
    8b 16 32 1 8 2 1 82.28
"""
# The only points the H100 profile's efficiency factors were set from (indices into MEASURED):
# single-node DP of the 1B model (matmul efficiency), single-node TP of the 8B (TP latency),
# the 8B on 64 nodes (inter-node latency), the 8B with PP across 2 nodes and the 3B with pp=16
# across 8 nodes (cross-node pipeline hop).
CALIBRATION = (0, 53, 70, 41, 69)


def measured_rows():
  rows = [r.split() for r in MEASURED.replace("\n", "|").split("|") if r.strip()]
  out = []
  for name, dp, tp, pp, ga, mbs, zero, tokens in rows:
    layout = Layout(data=int(dp), tensor=int(tp), pipeline=int(pp), microbatches=int(ga),
                    micro_batch=int(mbs), zero_stage=int(zero))
    out.append((f"playbook_{name}", layout, float(tokens)))
  return out


def predict(name, layout):
  model = dataclasses.replace(estimate.model_spec(MODELS[name]), flash_attention=True)
  return hardware.step_time(model, layout, 4096, estimate.PLAYBOOK_MIXED_FP32_ACCUM, H100,
                            hardware.NANOTRON_ORDER,  # nanotron's stages store activations
                            stages_recompute=False, lockstep=False, blocking_sends=True,
                            uniform_matmuls=True).tokens_per_s_per_gpu


def spearman(a, b):
  def ranks(x):
    order = sorted(range(len(x)), key=lambda i: x[i])
    return [order.index(i) for i in range(len(x))]
  ra, rb, n = ranks(a), ranks(b), len(a)
  return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def test_the_sample_covers_every_benchmark_model_and_the_calibration_points_are_few():
  rows = measured_rows()
  assert len(rows) == 100 and {n for n, _, _ in rows} == {f"playbook_{m}" for m in
                                                         ("1b", "3b", "8b", "80b")}
  assert all(layout.global_batch * 4096 == 2**20 for _, layout, _ in rows)
  assert len(CALIBRATION) == 5


def test_predicted_throughput_ranks_the_measured_layouts():
  """Ranking quality on the 95 points not used for calibration (numbers in the report):
  Spearman over all of them, within each (model, node count) group whose measured throughputs
  spread more than 1.5x, and the measured speed of each group's predicted-best layout against the
  group's measured best."""
  rows = measured_rows()
  held_out = [r for i, r in enumerate(rows) if i not in CALIBRATION]
  pred = [predict(n, lay) for n, lay, _ in held_out]
  real = [t for _, _, t in held_out]
  # Pooled over cells this was 0.89 before a cross-node group got one NIC per member on each
  # node (0.82 since): that rule predicts tp=16 too fast, which costs the pooled order across
  # models, and raised the per-cell scores of the whole sweep (test_the_whole_sweep_...), the
  # issue's measure. The per-group mean below rose from 0.56 to 0.61.
  assert spearman(pred, real) >= 0.8
  errors = sorted(abs(p / t - 1) for p, t in zip(pred, real))
  assert errors[len(errors) // 2] <= 0.3  # median relative error (measured 0.26, 0.20 before)
  groups = {}
  for (name, lay, _), p, t in zip(held_out, pred, real):
    groups.setdefault((name, lay.num_devices), []).append((p, t))
  spread = {k: v for k, v in groups.items() if len(v) >= 4 and
            max(t for _, t in v) > 1.5 * min(t for _, t in v)}
  rho = [spearman([p for p, _ in v], [t for _, t in v]) for v in spread.values()]
  assert len(rho) >= 6 and sum(rho) / len(rho) >= 0.4
  regret = [max(v)[1] / max(t for _, t in v) for v in spread.values()]
  assert min(regret) >= 0.9


def test_calibration_points_are_reproduced_within_a_quarter():
  rows = measured_rows()
  for i in CALIBRATION[:4]:
    name, layout, tokens = rows[i]
    assert predict(name, layout) / tokens == pytest.approx(1.0, abs=0.25), (i, layout)


# ---- the CLI ----


def meshtron(*args, timeout=120):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_memory_json_has_the_interface_fields(tmp_path):
  proc = meshtron("memory", "--model=llama3_8b", "--gpu=h100", "--seq=4096", "--json",
                  "--layout=dp=4,tp=2,zero=1,mbs=1,ga=8,remat=selective,sp=1",
                  f"--plot={tmp_path}/m.png")
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  for key in ("params_gb", "grads_gb", "optimizer_gb", "activations_gb", "total_gb", "fits",
              "step_time_s", "memory_bound_s", "tokens_per_s_per_gpu", "mfu"):
    assert key in out
  assert 0 < out["memory_bound_s"] < out["step_time_s"]
  assert out["params_gb"] == pytest.approx(2 * 8.03 / 2, rel=0.01)  # bf16, halved by tp=2
  assert os.path.getsize(tmp_path / "m.png") > 10_000


def test_plan_json_is_a_ranked_list_and_writes_a_config(tmp_path):
  out = tmp_path / "best.py"
  proc = meshtron("plan", "--model=llama3_8b", "--gpu=h100", "--nodes=2", "--gpus_per_node=8",
                  "--seq=4096", "--global_batch_tokens=1048576", "--json", "--top_k=5",
                  f"--out={out}")
  assert proc.returncode == 0, proc.stderr
  ranked = json.loads(proc.stdout)
  assert len(ranked) == 5 and all(r["num_gpus"] == 16 and r["fits"] for r in ranked)
  speeds = [r["tokens_per_s_per_gpu"] for r in ranked]
  assert speeds == sorted(speeds, reverse=True)
  text = out.read_text()
  assert "def get_config" in text and ranked[0]["layout"] in text
  assert ranked[0]["layout"].startswith("data=")  # the mesh's axis names, not dp/tp/pp


@pytest.mark.parametrize("args, message", [
    (["memory", "--model=gpt5", "--layout=dp=8"], "unknown model 'gpt5'"),
    (["memory", "--model=llama3_8b", "--layout=dp=8,tp"], "layout item 'tp'"),
    (["plan", "--model=llama3_8b", "--gpu=tpu"], "unknown gpu 'tpu'"),
    (["memory", "--model=llama3_8b", "--layout=tp=16"], "kv heads 8 not divisible by tensor=16"),
])
def test_bad_input_is_one_line(args, message):
  proc = meshtron(*args)
  assert proc.returncode != 0
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith("meshtron: error:") and message in lines[-1], proc.stderr


def test_compile_top_compiles_the_best_layouts_and_ranks_them_again(tmp_path):
  """--compile_top=2: the analytic top 2 compiled for h100x8 without a GPU; the JSON holds both
  rankings, every compiled layout its predicted step and compiled peak, and --out the fastest
  compiled layout that fits. (Each compile is ~14 s here; the slow 70B case compiles 16.)"""
  out = tmp_path / "best.py"
  proc = meshtron("plan", "--model=llama3_1b", "--nodes=1", "--compile_top=2", "--json",
                  f"--out={out}", timeout=400)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  analytic, compiled = report["analytic"], report["compiled"]
  assert [c["layout"] for c in compiled] == [a["layout"] for a in analytic[:2]]
  assert [c["analytic_rank"] for c in compiled] == [1, 2]
  for c, a in zip(compiled, analytic):
    assert c["compiled"] and c["tokens_per_s_per_gpu"] > 0 and c["compiled_peak_gib"] > 0
    assert c["tokens_per_s_per_gpu"] != a["tokens_per_s_per_gpu"]  # a second, different model
    assert 0 < c["mfu"] < 1 and c["fits"] == (c["compiled_peak_gib"] <= 79.2)
  fitting = [c for c in compiled if c["fits"]]
  best = max(fitting, key=lambda c: c["tokens_per_s_per_gpu"])
  assert best["layout"] in out.read_text()


@pytest.mark.slow
def test_compile_top_16_of_a_70b_on_8_nodes_prints_both_rankings():
  """`meshtron plan --model=llama3_70b --gpu=h100 --nodes=8 --compile_top=16` compiles 16 layouts
  and prints both rankings. Its time (issue [18]'s bound: under 5 minutes on 2 cores) is
  benchmarks/planner_speed.py's."""
  proc = meshtron("plan", "--model=llama3_70b", "--gpu=h100", "--nodes=8", "--compile_top=16",
                  timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = proc.stdout
  assert "layouts considered" in text and "compiled for h100x64 without a GPU: 16 layouts" in text
  assert "ranked by the step predicted from each program" in text


def test_the_planner_speed_benchmark_runs_the_search_its_results_record():
  """benchmarks/planner_speed.py measures issue [18]'s two bounds (analytic search of 70B on 512
  GPUs under 5 s; --compile_top=16 under 5 minutes on 2 cores). Its analytic half runs here and
  considers the layouts its committed results counted (tests/test_readme_figures.py checks
  docs/planning.md against those results)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "benchmarks.planner_speed", "--skip_compile_top",
                         "--repeats=1"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  fresh = json.loads(proc.stdout)
  assert fresh["benchmark"] == "analytic" and fresh["considered"] > 10_000 and fresh["best_s"] > 0
  path = os.path.join(REPO, "benchmarks", "results", "planner_speed.jsonl")
  committed = {r["benchmark"]: r for r in map(json.loads, open(path, encoding="utf-8"))}
  assert committed["analytic"]["considered"] == fresh["considered"]  # the same search as today's


def test_the_whole_sweep_is_scored_from_the_committed_data():
  """benchmarks/playbook_sweep.py: the derived data holds every successful 1M-token run of the
  four playbook models (26 (model, nodes) cells), the fit sample is 10% of the physical runs,
  the unfitted scores reproduce the committed results, and docs/planning.md shows them."""
  from benchmarks import playbook_sweep as sweep
  runs = sweep.runs()
  assert len(runs) == 1746 and all(int(r["dp"]) * int(r["mbs"]) * int(r["ga"]) == 256
                                   for r in runs)
  assert len({(r["model"], r["nodes"]) for r in runs}) == 26
  physical = [r for r in runs if not sweep.named_departure(r)]
  chosen = sweep.fit_sample(physical)
  assert len(chosen) == int(0.1 * len(physical)) <= 0.1 * len(runs)
  held_out = [r for i, r in enumerate(physical) if i not in chosen]
  committed = [json.loads(line) for line in open(sweep.RESULTS)]
  before = next(r for r in committed
                if r["kind"] == "built-in" and r["runs"] == "without named departures")
  fresh = sweep.score(held_out, H100)
  assert fresh["runs_scored"] == before["runs_scored"] == len(held_out) - fresh["refused"]
  assert fresh["refused"] == 1  # 28 layers on 32 stages (benchmarks/playbook_sweep.refusal)
  assert fresh["median_spearman"] == pytest.approx(before["median_spearman"])
  assert fresh["cells_first_ranked_at_least_0.9"] == before["cells_first_ranked_at_least_0.9"]
  # The targets, on the held-out runs without the named departures.
  assert fresh["median_spearman"] >= 0.8 and fresh["cells_first_ranked_at_least_0.9"] >= 22
  shown = docs_text.section("planning", sweep.BEGIN, sweep.END)
  assert shown.strip() == sweep.render(sweep.RESULTS).strip()


def test_the_named_departures_come_from_each_runs_record():
  """The two departures are read from a run's own record, never from a prediction: pipeline runs
  before nanotron's fix, and runs whose allocator reserved over 70 GB (benchmarks/
  playbook_sweep.named_departure); a cross-node group's bandwidth counts its members per node."""
  from benchmarks import playbook_sweep as sweep
  runs = sweep.runs()
  reasons = collections.Counter(sweep.named_departure(r) for r in runs)
  assert reasons["allocator pressure"] == sum(
      float(r["mem_reserved_gb"]) > 70 and not sweep.named_departure(r).startswith("pre")
      for r in runs) == 17
  assert reasons["pre-fix pipeline"] == sum(
      int(r["pp"]) > 1 and r["after_pp_fix"] == "False" for r in runs)
  # tp=16 spans two nodes with 8 members on each: 8 NICs' bandwidth; data=64 over tp=8, one.
  members = hardware.placement(Layout(data=4, tensor=16), 8, hardware.NANOTRON_ORDER)
  assert members == {"tensor": 8, "context": 1, "expert": 1, "fsdp": 1, "data": 1,
                     "pipeline": 1}
  members = hardware.placement(Layout(data=64, tensor=4), 8, hardware.NANOTRON_ORDER)
  assert members["tensor"] == 4 and members["data"] == 2
