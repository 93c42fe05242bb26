"""The analytic model: per-device memory, FLOPs and communication of a layout, GPU profiles (the
one home of every GPU constant), step time and the layout planner. Pure Python over numbers: it
calls no JAX function, but importing it loads jax, since it takes the run's own sharding.Layout
and rules (sharding/layout.py, sharding/rules.py), which do."""
