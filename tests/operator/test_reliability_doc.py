"""docs/reliability.md's table of rejected InferenceServices is rendered from tests/operator/invalid_specs.yaml.

The test fails when the committed table differs from the rendering;
`KVPILOT_WRITE_DOCS=1 python -P -m pytest tests/operator/test_reliability_doc.py` rewrites it.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "reliability.md"
TABLE = REPO_ROOT / "tests" / "operator" / "invalid_specs.yaml"
BEGIN = "<!-- invalid-specs:begin (rendered from tests/operator/invalid_specs.yaml; do not edit) -->"
END = "<!-- invalid-specs:end -->"
# The model every case names unless the case is about the model: left out of the table.
PLAIN_MODEL = {"uri": "pvc://models/llama"}
LONGEST_STRING = 32
MOST_ITEMS = 4


def _flow(value) -> str:
    """YAML flow style, long strings and lists shortened so a row stays readable."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_flow(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        shown = [_flow(item) for item in value[:MOST_ITEMS]]
        if len(value) > MOST_ITEMS:
            shown.append(f"... {len(value)} items")
        return "[" + ", ".join(shown) + "]"
    if isinstance(value, str):
        if len(value) > LONGEST_STRING:
            return f'"{value[:12]}..." ({len(value)} characters)'
        return f'"{value}"'
    return str(value)


def render_table(cases: list[dict]) -> str:
    rows = ["| # | spec (model `pvc://models/llama` unless shown) | rejected at | both validators say |",
            "|---|---|---|---|"]
    for number, case in enumerate(cases, 1):
        shown = {k: v for k, v in case["spec"].items() if not (k == "model" and v == PLAIN_MODEL)}
        spec_text = _flow(shown).replace("|", "\\|")
        rows.append(f"| {number} | {case['case']}: `{spec_text}` | `{case['field']}` | {case['message']} |")
    return "\n".join(rows)


def _rendered_doc(text: str, table: str) -> str:
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    assert begin and end, f"{DOC} lost its markers {BEGIN!r} ... {END!r}"
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def test_invalid_specs_table_in_the_doc_is_current():
    cases = yaml.safe_load(TABLE.read_text())
    text = DOC.read_text()
    expected = _rendered_doc(text, render_table(cases))
    if os.environ.get("KVPILOT_WRITE_DOCS") == "1":
        DOC.write_text(expected)
        text = expected
    assert text == expected, (
        f"{DOC.relative_to(REPO_ROOT)} is stale: run `KVPILOT_WRITE_DOCS=1 python -P -m pytest "
        f"tests/operator/test_reliability_doc.py` and commit it"
    )


def test_the_table_has_at_least_25_cases_each_naming_a_field():
    cases = yaml.safe_load(TABLE.read_text())
    assert len(cases) >= 25
    assert len({c["case"] for c in cases}) == len(cases)
    assert all(c["field"].startswith("spec.") and c["message"] for c in cases)
