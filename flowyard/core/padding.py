"""The rows a padded GEMM runs for a step of n tokens.

On the 2-core AVX2 EPYC MKL's float32 W @ x^T (the engine's skinny product, engine/skinny_gemm.py)
runs fast only when its skinny side is a multiple of 8: 15 rows took about twice 16 rows, and a
decode step's time jumped up and down with its batch size. The engine pads such products to
the next multiple (as vLLM pads a decode batch to a captured CUDA-graph size), and a profile
records the rule so its cost model prices each step at the rows the engine really multiplies.
Measured in benchmarks/results/skinny_pad.md (`python benchmarks/skinny_pad_speed.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class RowPadding:
    multiple: int = 8  # rows are rounded up to a multiple of this ...
    pad_from: int = 7  # ... from this many rows (6 rows unpadded were faster than 8) ...
    max_rows: int = 32  # ... up to this many (past it the engine calls F.linear, unpadded)

    def __post_init__(self) -> None:
        if not (self.multiple >= 1 and 1 <= self.pad_from <= self.max_rows and self.max_rows % self.multiple == 0):
            raise ValueError(f"row padding needs multiple >= 1, 1 <= pad_from <= max_rows and max_rows a "
                             f"multiple of multiple; got {self}")

    def rows(self, n):
        """Rows multiplied for n rows (an int, or an array of them elementwise)."""
        if isinstance(n, int):  # the engine's call, once per linear: no numpy on that path
            return -(-n // self.multiple) * self.multiple if self.pad_from <= n <= self.max_rows else n
        up = -(-np.asarray(n) // self.multiple) * self.multiple
        out = np.where((np.asarray(n) >= self.pad_from) & (np.asarray(n) <= self.max_rows), up, n)
        return int(out) if np.ndim(out) == 0 else out

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "RowPadding | None":
        if d is None:
            return None
        if not isinstance(d, dict) or set(d) - {"multiple", "pad_from", "max_rows"}:
            raise ValueError(f"row padding must be an object with multiple, pad_from and max_rows; got {d!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in d.values()):
            raise ValueError(f"row padding's fields must be integers; got {d!r}")
        return cls(**d)
