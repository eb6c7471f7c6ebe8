"""Benchmark suites: policy sweeps (simulated and real), plots, codec speed and the system suite."""
