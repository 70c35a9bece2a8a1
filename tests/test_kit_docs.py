"""Every catalogue section points at a doc of this repository that exists and explains it, and
nothing cites the design files the project started from (they are not in the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from offload_ref.contracts.registry import DOCS, doc_for
from offload_ref.contracts.runner import load_catalogue

ROOT = Path(__file__).resolve().parents[1]


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    in_code = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def _exists(target: str) -> bool:
    path, _, anchor = target.partition("#")
    doc = ROOT / path
    return path.startswith("docs/") and doc.is_file() and anchor in _anchors(doc)


@pytest.mark.parametrize("section", sorted({i.section for i in load_catalogue().values()}))
def test_every_catalogue_section_maps_to_an_existing_doc_heading(section: str) -> None:
    target = doc_for(section)
    assert _exists(target), f"§{section} -> {target}: no such file under docs/ or heading anchor"


def test_every_doc_target_exists_and_letters_a_to_j_are_covered() -> None:
    missing = [f"{k} -> {v}" for k, v in DOCS.items() if not _exists(v)]
    assert not missing, missing
    assert [doc_for(letter) for letter in "ABCDEFGHIJ"]
    assert doc_for("F.6") == "docs/strategies.md#alignment" and doc_for("§H.3") == doc_for("H")
    with pytest.raises(KeyError, match="no doc for catalogue section 'Z'"):
        doc_for("Z")


# contracts/pytest_support.py is being switched to doc_for by the engineer who edits it.
_ELSEWHERE = {"contracts/pytest_support.py"}


def test_nothing_cites_files_that_are_not_in_the_repository() -> None:
    cited = []
    files = [*ROOT.glob("offload_ref/**/*.py"), *ROOT.glob("contracts/**/*.py"),
             *ROOT.glob("fixtures/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in _ELSEWHERE:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(CONTRACTS|DESIGN)(\.md|'s)?\b", line):
                cited.append(f"{rel}:{n}: {line.strip()}")
    assert not cited, "\n".join(cited)
