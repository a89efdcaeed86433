"""The README's reproductions block is counted from the reports (flowyard/experiments/summary.py)."""

from __future__ import annotations

import json

import pytest

from flowyard.experiments.summary import BEGIN, END, headline_verdicts, read, splice, table

REPORT = """# Arrow

| claim (Arrow …) | paper | ours | ours vs paper |
|---|---|---|---|
| goodput over vLLM | 5.62× | 4.57× | reproduced (ours 4.57×; band 3.75×–8.43×) |
| goodput over 1P1D | 7.78× | 0.90× | not reproduced: wrong side of 1 (ours 0.90×) |
| over DP8 | — | n/a |  |
| SLO-aware over min load | 1.67× | ≥ 2.46× | undecided (a bound) |

## Later

| x | ours vs paper |
|---|---|
| y | reproduced |
"""


def test_counts_every_claims_table_and_skips_unjudged_rows():
    counts = headline_verdicts(REPORT, "ours vs paper")
    assert counts == {"reproduced": 2, "not reproduced": 1, "undecided": 1}


def test_a_report_without_the_column_is_an_error():
    with pytest.raises(ValueError, match="verdict"):
        headline_verdicts(REPORT, "verdict")


def test_the_block_names_each_reports_revision_and_command(tmp_path):
    (tmp_path / "arrow.md").write_text(REPORT)
    (tmp_path / "arrow").mkdir()
    prov = {"revision": "abcdef1234", "dirty": [], "command": "flowyard reproduce arrow", "wall_s": 600.0}
    (tmp_path / "arrow" / "results.json").write_text(json.dumps({"provenance": prov}))
    s = read("arrow", tmp_path)
    assert s.revision == "abcdef1" and not s.dirty and s.wall_s == 600.0
    block = table([s])
    assert "1 not reproduced, 2 reproduced, 1 undecided" in block
    assert "abcdef1" in block and "10 min" in block and "all at one revision" in block


def test_splice_replaces_only_the_marked_block():
    readme = f"intro\n{BEGIN}\nold\n{END}\noutro\n"
    assert splice(readme, "new") == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"
    with pytest.raises(ValueError, match="block"):
        splice("no markers", "new")
