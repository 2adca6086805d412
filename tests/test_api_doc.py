"""docs/api.md, the users' API reference, stays in step with the package: every `gd.` name
it documents as available resolves, and every name it lists as not yet available does not
(so the day one lands, this test asks for the page to move it)."""

import re
from pathlib import Path

import pytest

import graphdist as gd

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
PLANNED = "## Not yet available"
NAME = re.compile(r"\bgd\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


def _names(text: str) -> set[str]:
    """The dotted names after `gd.`, and the bare names of a list that opens with one
    (`gd.matmul, add, subtract`: numpy's names, one prefix for the whole list)."""
    names = set(NAME.findall(text))
    for span in re.findall(r"`(gd\.[^`]*)`", text, re.S):
        items = [item.strip() for item in span.split(",")]
        if not re.fullmatch(r"gd(\.\w+)+", items[0]):
            continue                 # a call's signature, not a list of names
        prefix = items[0].rpartition(".")[0]
        names.update(f"{prefix}.{item}"[3:] for item in items[1:] if item.isidentifier())
    return names


def _resolves(dotted: str) -> bool:
    obj = gd
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


TEXT = DOC.read_text()
AVAILABLE, _, PLANNED_TEXT = TEXT.partition(PLANNED)


def test_the_reference_has_both_parts():
    assert PLANNED_TEXT, f"{DOC} lost its '{PLANNED}' section"
    assert len(_names(AVAILABLE)) > 100


@pytest.mark.parametrize("name", sorted(_names(AVAILABLE)))
def test_documented_name_exists(name):
    assert _resolves(name), f"docs/api.md documents gd.{name}, which graphdist does not have"


@pytest.mark.parametrize("name", sorted(_names(PLANNED_TEXT)))
def test_planned_name_is_not_there_yet(name):
    assert not _resolves(name), (
        f"gd.{name} exists now: move it from '{PLANNED}' into its section of docs/api.md")
