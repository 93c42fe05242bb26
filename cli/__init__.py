"""The `meshtron` commands: the parser (flags.py), one module per verb (train, compile, memory,
plan, convert), and what reaches the terminal (console.py). The entry point is main.py."""
