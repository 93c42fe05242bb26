import json, sys
sys.path.insert(0, '.')
from tests import training_runs as tr
import numpy as np
ex = "xla_gpu_deterministic_ops=true"
r = []
for i in range(2):
  tr.losses.cache_clear()
  r.append((tr.losses(100, dtype="bfloat16", xla_options=ex), tr.losses(100, dtype="bfloat16", fp8=True, xla_options=ex)))
gap = lambda a, b: max(abs(np.mean(a[i:i+10]) / np.mean(b[i:i+10]) - 1) for i in range(0, 100, 10))
print(json.dumps({"via": "compiler_options", "same_bf16": r[0][0] == r[1][0], "same_fp8": r[0][1] == r[1][1], "gap": [round(float(gap(f, b)), 4) for b, f in r]}))
