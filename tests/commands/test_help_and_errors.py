"""The command line's help and messages: class names as --target, --help with defaults and
examples, a quick --help that imports no torch, the file --out really wrote, plurals and
articles (in the front's errors too). The front's errors that name the fix:
tests/core/test_input_errors.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

from captum_vit import GAE, zoo
from captum_vit._base import check_target
from captum_vit.adapters import adapt
from captum_vit.cli import main
from captum_vit.commands.options import parse_class
from captum_vit.models import class_index
from tests.helpers import make_inputs, make_model

FMNIST = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
          "Bag", "Ankle boot")
needs_zoo = pytest.mark.skipif("vit_fmnist_loc" not in zoo.available(),
                               reason="bundled model missing")


# -- --target NAME ----------------------------------------------------------------------------
def test_parse_class_takes_indices_and_names_in_any_case():
    assert parse_class("7", FMNIST, 10) == 7 and parse_class(None, FMNIST, 10) is None
    for spelling in ("Sneaker", "sneaker", "SNEAKER", " sneaker "):
        assert parse_class(spelling, FMNIST, 10) == 7
    assert parse_class("ankle boot", FMNIST, 10) == 9
    assert parse_class("t-shirt top", FMNIST, 10) == 0
    assert class_index("tench", ["tench, Tinca tinca", "goldfish"]) == 0
    with pytest.raises(ValueError, match=r"--target must be in \[0, 10\), got 10"):
        parse_class("10", FMNIST, 10)
    with pytest.raises(ValueError, match="not a class name.*Sneaker.*Ankle boot.*index"):
        parse_class("Snekaer", FMNIST, 10)
    with pytest.raises(ValueError, match="no class names.*--classes"):
        parse_class("cat", None, 10)
    with pytest.raises(ValueError, match="several classes"):
        class_index("a", ["A", "a"])


@needs_zoo
def test_explain_target_by_class_name(tmp_path, capsys):
    argv = ["explain", "--methods", "rollout", "--out", str(tmp_path / "t.png")]
    assert main(argv + ["--target", "sneaker"]) == 0
    assert "explaining Sneaker" in capsys.readouterr().out
    assert main(argv + ["--target", "Snekaer"]) == 2
    err = capsys.readouterr().err
    assert "--target 'Snekaer'" in err and "Sneaker" in err and "T-shirt/top" in err


# -- --help -----------------------------------------------------------------------------------
def test_help_shows_defaults_and_examples_without_rest_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "examples:" in top and "captum-vit explain" in top and "``" not in top
    for command in ("explain", "evaluate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "``" not in text and "(default: " in text
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: explain.png)" in text and "(default: 0)" in text
    assert "examples:" in text and "--target Sneaker" in text


def test_help_is_quick_and_imports_no_torch():
    code = ("import sys, io, contextlib\n"
            "import captum_vit.cli as cli\n"
            "parser = cli.build_parser()\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    parser.print_help()\n"
            "assert 'explain' in out.getvalue()\n"
            "heavy = [m for m in ('torch', 'timm', 'captum', 'matplotlib') if m in sys.modules]\n"
            "print(heavy)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


# -- --out without suffix ---------------------------------------------------------------------
def test_out_without_suffix_reports_the_file_written(tmp_path, capsys):
    out = tmp_path / "maps"
    assert main(["explain", "--model", "random:vit_tiny", "--methods", "rollout",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}.png:" in text and (tmp_path / "maps.png").is_file()
    assert not out.exists()


# -- plurals and articles ---------------------------------------------------------------------
def test_messages_use_singular_and_the_right_article(tmp_path, capsys):
    assert main(["explain", "--model", "random:vit_tiny", "--methods", "rollout",
                 "--out", str(tmp_path / "x.png")]) == 0
    assert ": 1 method," in capsys.readouterr().out
    with pytest.raises(ValueError, match="target has 2 entries but the batch has 1 image;"):
        check_target([0, 1], 1, 5)

    class Xcit(nn.Module):
        pass

    class Sequential2(nn.Module):
        pass

    with pytest.raises(TypeError, match="cannot explain an Xcit"):
        adapt(Xcit())
    with pytest.raises(TypeError, match="cannot explain a Sequential2"):
        adapt(Sequential2())
    with pytest.raises(ValueError, match="a tuple of 2 items"):
        GAE(make_model()).attribute((make_inputs(), make_inputs()))
