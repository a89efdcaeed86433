"""Benchmark reporting: vLLM-style tables, JSON results and goodput/CDF figures."""

from flowyard.bench.plot import plot_cdf, plot_goodput
from flowyard.bench.report import (format_goodput_table, format_table, write_goodput_json,
                                   write_json)

__all__ = ["format_table", "format_goodput_table", "write_json", "write_goodput_json",
           "plot_goodput", "plot_cdf"]
