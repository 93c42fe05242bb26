import json, sys, itertools
import jax, numpy as np
sys.path.insert(0, '.')
from tests import training_runs as tr
runs = {}
for fp8 in (False, True):
  for i in range(3):
    tr.losses.cache_clear()
    runs[f"{'fp8' if fp8 else 'bf16'}{i}"] = tr.losses(100, dtype="bfloat16", fp8=fp8)
def gap(a, b):
  return max(abs(np.mean(a[i:i+10]) / np.mean(b[i:i+10]) - 1) for i in range(0, 100, 10))
out = {"flags": sys.argv[1], "device": str(jax.devices()[0])}
for x, y in itertools.combinations(runs, 2):
  out[f"{x}-{y}"] = round(float(gap(runs[x], runs[y])), 4)
out["identical_bf16"] = runs["bf160"] == runs["bf161"]
print(json.dumps(out))
