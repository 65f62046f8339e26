"""Measurement: the benchmark harness (`bench`), the budget calibration (`calibrate`) and what
every measurement records about where it ran (`env`). The engine never imports this package."""
