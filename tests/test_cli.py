"""The ``captum-vit`` command line and the README / CI contract."""

from __future__ import annotations

import re
from pathlib import Path

from captum_vit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_explain_writes_a_png(tmp_path, capsys):
    out = tmp_path / "maps.png"
    assert main(["explain", "--out", str(out), "--methods", "gae,rollout"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_explain_rejects_unknown_method_and_model(tmp_path, capsys):
    out = str(tmp_path / "x.png")
    assert main(["explain", "--out", out, "--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["explain", "--out", out, "--model", "bogus:thing"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(c for c in commands if "pytest" in c).split("&&")[-1].strip()
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
