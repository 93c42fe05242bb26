"""meshtron's benchmarks: each module runs as `python -m benchmarks.<name>` from the repo root."""
