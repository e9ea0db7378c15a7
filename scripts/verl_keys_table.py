"""Write the verl key table (offstep/launch/verl/table.py) into docs/from-verl.md: its summary line
and the Markdown table between the ``<!-- key-table -->`` markers. tests/launch/test_verl_compat.py keeps
the page equal to what this renders.

    python scripts/verl_keys_table.py            # rewrite the page's table
    python scripts/verl_keys_table.py --check    # exit 1 where the page is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from offstep.launch.verl.table import PREFIXES, TABLE, Derived, Note, To  # noqa: E402  (the checkout's offstep)

PAGE = ROOT / "docs" / "from-verl.md"
TABLE_SPAN = re.compile(r"(<!-- key-table -->\n)(.*)(\n<!-- /key-table -->)", re.S)
SUMMARY = re.compile(r"^Summary: .*$", re.M)


def markdown_table() -> str:
    """Every entry of ``TABLE`` and ``PREFIXES`` as a Markdown table (docs/from-verl.md holds it)."""
    rows = ["| verl key | treatment | offstep |", "| --- | --- | --- |"]

    def cell(rule) -> tuple[str, str]:
        if isinstance(rule, To):
            how = "translated" + (" (value converted)" if rule.convert else "")
            return how, f"`{rule.key}`" + (f": {rule.note}" if rule.note else "")
        if isinstance(rule, Derived):
            return "translated (derived)", f"`{rule.targets}`: {rule.how}"
        if isinstance(rule, Note):
            return "noted", rule.why
        allowed = ", ".join("null" if a is None else repr(a) for a in rule.allow)
        return "refused" + (f" (except {allowed})" if allowed else ""), rule.why

    for key, rule in TABLE.items():
        how, what = cell(rule)
        rows.append(f"| `{key}` | {how} | {what} |")
    for prefix, rule in PREFIXES:
        how, what = cell(rule)
        rows.append(f"| `{prefix}*` | {how} | {what} |")
    return "\n".join(rows).replace("${", "$\\{")


def summary_line() -> str:
    """How many entries of each kind the table has, as the page says it."""
    kinds = {"translated": 0, "noted": 0, "refused": 0}
    for rule in [*TABLE.values(), *(r for _, r in PREFIXES)]:
        kinds[
            "translated" if isinstance(rule, (To, Derived)) else "noted" if isinstance(rule, Note) else "refused"
        ] += 1
    return (
        f"Summary: {kinds['translated']} entries translated, {kinds['noted']} noted, {kinds['refused']} refused "
        f"(exact keys and key groups)."
    )


def render(page: str) -> str:
    """``page`` with its summary line and key table made current."""
    assert TABLE_SPAN.search(page) and SUMMARY.search(page), f"{PAGE} lost its key-table markers or summary line"
    page = SUMMARY.sub(lambda _: summary_line(), page, count=1)
    return TABLE_SPAN.sub(lambda m: m.group(1) + markdown_table() + m.group(3), page, count=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="say whether the page is current; change nothing")
    args = ap.parse_args()
    page = PAGE.read_text(encoding="utf-8")
    new = render(page)
    if args.check:
        print(
            f"{PAGE.relative_to(ROOT)}: {'current' if new == page else 'stale: run python scripts/verl_keys_table.py'}"
        )
        return int(new != page)
    PAGE.write_text(new, encoding="utf-8")
    print(f"{PAGE.relative_to(ROOT)}: {'unchanged' if new == page else 'table rewritten'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
