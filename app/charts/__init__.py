"""Live charts (pyqtgraph): VRAM by process with the budget line, tokens/s, time to first token, and
the plan per token tier. Each keeps a bounded history and redraws at the panel's 4 Hz tick."""
