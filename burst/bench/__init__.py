"""Benchmark harness behind `burst bench`."""

from .harness import BenchConfig, format_table, run_bench, write_json

__all__ = ["BenchConfig", "format_table", "run_bench", "write_json"]
