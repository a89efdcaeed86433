"""The rows a padded GEMM runs for a step of n tokens.

On the 2-core AVX2 EPYC MKL's float32 W @ x^T (the engine's skinny product, engine/skinny_gemm.py)
runs fast only at some row counts: 15 rows took about twice 16 and 3 rows longer than 4, so a
decode step's time jumped up and down with its batch size. The engine pads such products to the
next fast count (as vLLM pads a decode batch to a captured CUDA-graph size), and a profile records
the rule so its cost model prices each step at the rows the engine really multiplies. Measured in
benchmarks/results/skinny_pad.md (`python benchmarks/skinny_pad_speed.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Range = tuple[int, int, int]  # (lo, hi, multiple): lo <= n <= hi rounds up to a multiple


@dataclass(frozen=True)
class RowPadding:
    ranges: tuple[Range, ...]  # the engine's rule: skinny_gemm.ROW_PADDING

    def __post_init__(self) -> None:
        last = 0
        for r in self.ranges:
            if not (len(r) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)):
                raise ValueError(f"row padding ranges are (lo, hi, multiple) integers; got {r!r}")
            lo, hi, m = r
            if not (last < lo <= hi and m >= 1 and hi % m == 0):
                raise ValueError(f"row padding range {r!r}: needs ascending, disjoint ranges with lo <= hi "
                                 "and hi a multiple of multiple")
            last = hi

    def rows(self, n):
        """Rows multiplied for n rows (an int, or an array of them elementwise)."""
        if isinstance(n, int):  # the engine's call, once per linear: no numpy on that path
            for lo, hi, m in self.ranges:
                if lo <= n <= hi:
                    return -(-n // m) * m
            return n
        a = np.asarray(n)
        out = a
        for lo, hi, m in self.ranges:
            out = np.where((a >= lo) & (a <= hi), -(-a // m) * m, out)
        return int(out) if np.ndim(out) == 0 else out

    def to_dict(self) -> dict[str, list[list[int]]]:
        return {"ranges": [list(r) for r in self.ranges]}

    @classmethod
    def from_dict(cls, d: dict | None) -> "RowPadding | None":
        """A profile's `gemm_row_padding`: {"ranges": [[lo, hi, multiple], ...]}, or the one-range
        form {"multiple", "pad_from", "max_rows"} that profiles made before 3 rows were padded record."""
        if d is None:
            return None
        if isinstance(d, dict) and set(d) == {"multiple", "pad_from", "max_rows"}:
            d = {"ranges": [[d["pad_from"], d["max_rows"], d["multiple"]]]}
        if not isinstance(d, dict) or set(d) != {"ranges"} or not isinstance(d["ranges"], list):
            raise ValueError(f"row padding must be an object with ranges [[lo, hi, multiple], ...]; got {d!r}")
        if not all(isinstance(r, list) for r in d["ranges"]):
            raise ValueError(f"row padding ranges are [lo, hi, multiple] lists; got {d['ranges']!r}")
        return cls(tuple(tuple(r) for r in d["ranges"]))
