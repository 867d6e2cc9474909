"""Benchmarks: schedules side by side on an emulated commodity interconnect (see link.py)."""
