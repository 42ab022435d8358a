"""User-facing text cites papers and the package's own modules, never internal planning
documents, tracker items or the internal names of source scripts (users have none of them).

Scanned: the source text of ``captum_vit/`` without its comments (docstrings and message
strings; comments are for contributors), ``README.md``, the ``--help`` of ``captum-vit`` and
of each command, the texts of the evaluation presets (``protocol.md`` and the printed
settings of :data:`captum_vit.metrics.protocols.PROTOCOLS`) and the tutorials' cells.

A section sign ``§`` must say whose section it is: a paper, an author or a paper-ish token
(``et al.``, ``SkipPLUS``, ``Eq.``, ``Table``, a year, a venue, ...) within the 40 characters
before it.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = re.compile(
    r"\bSPEC(?:_NEXT|_REACH)?\b"  # the specs (public names such as SPEC_HELP do not match)
    r"|\bDESIGN\.md\b"
    r"|\.\./shared"
    r"|\b[Ii]ssues?\s+#?\d+"  # tracker items
    r"|\bseed\s+#?00\d\b"  # internal names of the source papers' texts ...
    r"|\bseeds'|\bseed\s+(?:methods?|papers?|tables?|scripts?)\b")  # ... and of the papers
PAPERISH = re.compile(
    r"et al\.|\bApp(?:endix|\.)|\bEqs?\.|\bTables?\b|\bFigs?\.|\bAlg\.|\bSec\.|\bpapers?\b"
    r"|\b(?:SkipPLUS|PLUS|TokenTM|TIS|Chefer(?:'21)?|DecompX|AttnLRP|CP-LRP|LeGrad|GlobEnc"
    r"|ALTI|Grad-SAM|RISE|ViT-CX|SaCo|LXT|LibraGrad|Beyond Intuition|TAM|AttCAT|CAM)\b"
    r"|\b(?:CVPRW?|ICCVW?|ICCV-W|ECCV|NeurIPS|ICML|ICLR|ACL|NAACL|EMNLP|TMLR|IJCAI|BMVC)\b"
    r"|\b(?:19|20)\d\d\b")
WINDOW = 40


def internal_references(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every internal reference in ``text`` (1-based line numbers)."""
    hits = []
    for m in FORBIDDEN.finditer(text):
        hits.append(m.start())
    for m in re.finditer("§", text):
        before = re.sub(r"\s+", " ", text[max(0, m.start() - 3 * WINDOW):m.start()])
        if not PAPERISH.search(before[-WINDOW:]):
            hits.append(m.start())
    lines = text.split("\n")
    rows = sorted({text.count("\n", 0, pos) for pos in hits})
    return [(n + 1, lines[n].strip()) for n in rows]


def without_comments(source: str) -> str:
    """``source`` with every comment blanked (line numbers kept)."""
    lines = source.splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            line = lines[row - 1]
            lines[row - 1] = line[:col] + " " * (tok.end[1] - col) + line[tok.end[1]:]
    return "".join(lines)


def package_texts(root: Path = ROOT) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of every source file of the package, comments blanked."""
    for path in sorted((root / "captum_vit").rglob("*.py")):
        text = without_comments(path.read_text(encoding="utf-8"))
        yield str(path.relative_to(root)), text


def readme_texts(root: Path = ROOT) -> Iterator[tuple[str, str]]:
    yield "README.md", (root / "README.md").read_text(encoding="utf-8")


def tutorial_texts(root: Path = ROOT) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of every tutorial cell (markdown, and the code cells' comments)."""
    for path in sorted((root / "tutorials").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            src = cell["source"]
            yield f"{path.relative_to(root)} cell {i}", "".join(src) if isinstance(src, list) \
                else src


def help_texts() -> Iterator[tuple[str, str]]:
    """``--help`` of ``captum-vit`` and of each of its commands."""
    import argparse

    from captum_vit.cli import build_parser

    parser = build_parser()
    yield "captum-vit --help", parser.format_help()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        yield f"captum-vit {name} --help", command.format_help()


def protocol_texts() -> Iterator[tuple[str, str]]:
    """What ``captum-vit evaluate --protocol NAME`` prints and writes to ``protocol.md``."""
    from captum_vit.metrics.protocols import PROTOCOLS, protocol_table

    for name, p in PROTOCOLS.items():
        yield f"PROTOCOLS[{name!r}].summary()", p.summary()
        yield f"PROTOCOLS[{name!r}] protocol.md", protocol_table(
            p, {}, {"model": "m", "data": "d", "n": 0})
        yield f"PROTOCOLS[{name!r}].notes", p.notes
        yield f"PROTOCOLS[{name!r}].source", p.source


def report(texts: Iterable[tuple[str, str]]) -> list[str]:
    """``name:line: text`` of every internal reference in ``texts``."""
    return [f"{name}:{line}: {snippet}" for name, text in texts
            for line, snippet in internal_references(text)]


@pytest.mark.parametrize("source", [package_texts, readme_texts, tutorial_texts, help_texts,
                                    protocol_texts],
                         ids=["package", "readme", "tutorials", "help", "protocols"])
def test_user_facing_text_has_no_internal_references(source):
    found = report(source())
    assert not found, (
        "user-facing text cites internal planning documents or tracker items; cite the "
        "paper (authors, venue, year, its own section) or the package's module instead:\n"
        + "\n".join(found))


@pytest.mark.parametrize("text,bad", [
    ("the linearised backward (SPEC §3)", True),
    ("as SPEC_NEXT §8.5 says", True),
    ("the SPEC's choice", True),
    ("see ../shared/DESIGN.md", True),
    ("DESIGN.md has it", True),
    ("### The baselines (issue 20)", True),
    ("Issue 22 fixed it", True),
    ("seed 000 Eq. 1", True),
    ("as the seeds' scripts resize", True),
    ("| seed table | command |", True),
    ("a seeded subset (--subset-seed S), seed 0", False),
    ("rolled out (§8.5)", True),
    ("a bare reference: §7.1", True),
    ("models.SPEC_HELP lists the model specs", False),
    ("SkipPLUS (Mehri et al. 2024, §5.1)", False),
    ("TokenTM (Wu et al., CVPR 2024) §4.4", False),
    ("the paper's §4.1, A.1-A.2", False),
    ("Chefer'21 (CVPR 2021, Eq. 9–13)\n    and its\n    §3.2", False),
    ("a model spec such as zoo:vit", False),
])
def test_the_scanner_itself(text, bad):
    assert bool(internal_references(text)) is bad, internal_references(text)


def test_comments_are_not_scanned():
    src = 'x = 1  # SPEC §3\n# SPEC_NEXT §8\ny = "fine"\n'
    assert internal_references(without_comments(src)) == []
    assert internal_references(without_comments('y = "SPEC §3"\n')) == [(1, 'y = "SPEC §3"')]
