"""What reads compiled programs: HLO collectives, overlap, compiled-program reports and GPU
targets for deviceless compiles, and the named presets of XLA options."""
