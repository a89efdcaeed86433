"""The figure registry: every figure and table each paper's text mentions is registered, each entry
names an importable function or says why nothing reproduces it, every figure a report shows is
registered as built, and the reports' "figures not reproduced" sections are generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowyard.experiments.figures import (NOT_BUILT_HEADING, PAPERS, REGISTRY, Figure, lookup, mentioned,
                                          not_built_section, registry, rendered)

PAPER_DIR = Path(__file__).resolve().parents[2] / "shared" / "papers"


def _figure_labels(figs: list[Figure]) -> set[str]:
    return set().union(*(mentioned(f.label) for f in figs))


@pytest.mark.parametrize("paper", PAPERS)
def test_every_figure_and_table_of_the_paper_is_registered(paper):
    path = PAPER_DIR / f"{paper}.txt"
    if not path.exists():
        pytest.skip(f"paper text not present at {path}")
    in_text = mentioned(path.read_text(encoding="utf-8"))
    assert in_text, paper
    labels = _figure_labels(registry(paper))
    assert in_text <= labels, f"{paper}: unregistered {sorted(in_text - labels)}"
    assert labels <= in_text, f"{paper}: registered but not in the paper {sorted(labels - in_text)}"


def test_entries_are_well_formed_and_built_ones_resolve():
    seen = set()
    for f in REGISTRY:
        assert (f.paper, f.label) not in seen, f
        seen.add((f.paper, f.label))
        if f.built:
            assert callable(f.resolve()), f
            assert f.part, f
        else:
            assert len(f.why) > 20, f  # a reason, not a placeholder
    with pytest.raises(ValueError):
        Figure("dynaserve", "Fig. 99", "both", built_by="x:y", why="z")
    with pytest.raises(ValueError):
        Figure("dynaserve", "Fig. 99", "neither")
    with pytest.raises(ValueError):
        registry("no-such-paper")
    with pytest.raises(KeyError):
        lookup("arrow", "Fig. 99")


def test_mentioned_reads_ranges_and_lists():
    assert mentioned("Figs. 3 and 4; Figure 10, Table 2 and Figs. 8-9") == {
        "Fig. 3", "Fig. 4", "Fig. 10", "Table 2", "Fig. 8", "Fig. 9"}
    assert mentioned("Fig.6 and the figure above") == {"Fig. 6"}


def test_section_is_generated_and_rejects_unknown_details():
    text = not_built_section("flowprefill", notes=["- a note"])
    for f in registry("flowprefill"):
        assert (f"**{f.label}** ({f.title})" in text) == (not f.built), f.label
    assert text.endswith("- a note")
    with pytest.raises(KeyError):
        not_built_section("arrow", {"Fig. 99": "x"})


def test_rendered_ignores_the_not_reproduced_section():
    md = ("# T\n\n## Fig. 9: curves\n\n| claim | paper | ours | ours vs paper |\n|---|---|---|---|\n"
          "| Fig. 10 gain | 1× | 1× | reproduced |\n\n" + NOT_BUILT_HEADING + "\n\n- **Fig. 13** (x): y\n\n## Next\n")
    assert rendered(md) == {"Fig. 9", "Fig. 10"}


def assert_rendered_are_built(paper: str, markdown: str) -> None:
    """Every figure `markdown` shows is registered as built, and its not-built section is the
    registry's (used by the tests that generate each report)."""
    built = {f.label for f in registry(paper) if f.built}
    shown = rendered(markdown)
    assert shown, paper
    assert shown <= built, f"{paper}: shown but not registered as built: {sorted(shown - built)}"
    section = markdown.split(NOT_BUILT_HEADING)[1].split("\n## ")[0]
    for f in registry(paper):
        if not f.built:
            assert f"**{f.label}** ({f.title})" in section, f.label


def test_flowprefill_and_pla_reports_render_only_built_figures(tmp_path):
    from test_reproduce_notes import _fp, _fp_report, _pla, _pla_report

    assert_rendered_are_built("flowprefill", _fp_report(_fp(1.5), tmp_path / "fp"))
    assert_rendered_are_built("pla-serve", _pla_report(_pla(0.2), tmp_path / "pla"))
