"""fp8 matmuls: the recipes' settings (config.py), delayed scaling with amax histories
(delayed.py), current scaling, tensorwise/rowwise/blockwise (current.py), the dropless MoE's
grouped GEMMs (grouped.py), and weights quantized once per step (weights.py)."""
