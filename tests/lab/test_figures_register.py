"""The claim register's bookkeeping on hand-made figure entries: verdicts taken from the
picked row, totals that add up to the register, unpicked rows as library checks."""

from __future__ import annotations

from typing import Any

import pytest

from gradbalance_lab.figures import register
from gradbalance_lab.figures._common import Claim
from gradbalance_lab.figures.register import (
    BY_KIND,
    REGISTER,
    Row,
    library_checks,
    register_lines,
    resolve,
    summary,
    tally,
)


def _entries(met: bool | None, extra: Claim | None = None) -> list[dict[str, Any]]:
    """One entry per figure the register names, holding exactly the claims its keys pick."""
    out: dict[str, dict[str, Any]] = {}
    for row in REGISTER:
        if row.figure:
            entry = out.setdefault(row.figure, {"name": row.figure, "missing": None,
                                                "claims": []})
            if not any(row.key in c.text for c in entry["claims"]):
                entry["claims"].append(Claim(f"text with {row.key}", "1", met))
    if extra is not None:
        next(iter(out.values()))["claims"].append(extra)
    return list(out.values())


def test_totals_match_the_register() -> None:
    measured = sum(bool(r.figure) for r in REGISTER)
    counts = tally(resolve(_entries(True)))
    assert counts["met"] == measured  # all 'met' by hand
    unmeasurable = sum(not r.figure and not r.measurable for r in REGISTER)
    assert counts["not measurable"] == unmeasurable > 0
    covered = sum(bool(r.by) for r in REGISTER)
    assert counts[BY_KIND] == covered > 0
    assert counts["not measured"] == len(REGISTER) - measured - unmeasurable - covered
    assert sum(counts.values()) == len(REGISTER)
    counts = tally(resolve(_entries(False)))
    assert counts["not met"] == measured and counts["met"] == 0


def test_a_figure_not_run_is_counted_not_run() -> None:
    entries = [e for e in _entries(True) if e["name"] != "clipping"]
    counts = tally(resolve(entries))
    picked = sum(r.figure == "clipping" for r in REGISTER)
    assert picked > 0 and counts["not run"] == picked
    assert sum(counts.values()) == len(REGISTER)


def test_an_unpicked_row_is_a_library_check_and_not_counted() -> None:
    extra = Claim("§x (check) the batched runs are the library's", "0", True)
    entries = _entries(True, extra)
    assert [c for _, c in library_checks(entries)] == [extra]
    assert tally(resolve(entries))["met"] == sum(bool(r.figure) for r in REGISTER)
    lines = register_lines(entries)
    assert "## Library checks" in lines and any("(check) the batched" in x for x in lines)
    assert f"{len(REGISTER)} claims of the two texts" in summary(entries)


def test_a_stale_key_names_the_row() -> None:
    entries = _entries(True)
    entries[0]["claims"] = entries[0]["claims"][1:]  # drop one picked row
    with pytest.raises(ValueError, match="picks 0 claims"):
        resolve(entries)


def test_every_row_names_its_section_and_quote() -> None:
    for row in REGISTER:
        assert row.text in ("balancing", "clipping")
        assert row.section and row.quote
        assert bool(row.figure) == bool(row.key)
        assert bool(row.figure) != bool(row.reason)
        assert row.measurable or not row.figure  # a measured row is measurable
        assert not row.by or (row.measurable and not row.figure)


def test_a_row_measured_by_others_names_their_numbers() -> None:
    """The §8 summary names the register numbers of the momentum row and Adam's tilt row,
    counted by hand from the register; it takes no verdict of its own."""
    numbers = {(r.figure, r.key): i for i, r in enumerate(REGISTER, 1)}
    for row, verdict, claim in resolve(_entries(False)):
        if row.by:
            expected = ", ".join(str(numbers[ref]) for ref in row.by)
            assert verdict.startswith(f"measured by rows {expected}: ") and claim is None
            assert "met" not in verdict.split(":")[0]


def test_a_reference_to_no_row_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    stale = Row("balancing", "§0", "words", "—", "—", reason="a summary",
                by=(("momentum", "no such key"),))
    monkeypatch.setattr(register, "REGISTER", (*REGISTER, stale))
    with pytest.raises(ValueError, match="no such key"):
        register.resolve(_entries(True))


def test_only_rows_not_known_unmet_fail_the_run() -> None:
    # every measured row not met: those the register marks `unmet` (the text's number known
    # not to be reproduced, documented) are apart; any other one fails the run
    entries = _entries(False)
    unexpected, known = register.unexpected_unmet(entries)
    marked = [row for row in REGISTER if row.unmet]
    assert len(marked) == len(known) == 2
    assert all(label.startswith(f"{row.figure}: ") and row.key in label
               for row, label in zip(marked, known, strict=True))
    assert len(unexpected) + len(known) == sum(len(e["claims"]) for e in entries)
    unexpected, known = register.unexpected_unmet(_entries(True))
    assert unexpected == [] and known == []
