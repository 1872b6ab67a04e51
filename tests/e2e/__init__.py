"""Whole processes: crash and power-loss runs, real-time timers, the benchmark harness, the browser console."""
