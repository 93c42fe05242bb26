"""The analytic model (pure Python, no JAX): per-device memory, FLOPs and communication of a
layout, GPU profiles (the one home of every GPU constant), step time and the layout planner."""
