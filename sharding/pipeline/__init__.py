"""Pipeline parallelism: the schedules' tick tables (schedules.py; each schedule a per-stage
policy in policies.py, run by the one simulator in ticks.py), the layer stacks' split over
stages (stage_split.py) and the executor that runs a table inside the one SPMD program
(executor.py)."""
