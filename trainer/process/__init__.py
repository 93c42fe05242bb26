"""Process plumbing around a run: jax.distributed start-up and its join watch, the malloc settings
the process restarts under, preemption signals, and the working directory's lock and files."""
