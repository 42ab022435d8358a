"""Command-line and API papercuts: class names as --target, --help with defaults and
examples, the file --out really wrote, plurals and articles, a quick --help that imports
no torch, and errors that name the fix (grayscale inputs, wrappers, non-tensor inputs,
TokenTM's variant in any case)."""

from __future__ import annotations

import subprocess
import sys
from collections import UserDict

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from captum_vit import GAE, TokenTM, zoo
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


def test_lazy_package_exports_every_public_name():
    import captum_vit

    for name in captum_vit.__all__:
        assert getattr(captum_vit, name) is not None
    assert "GAE" in dir(captum_vit)
    with pytest.raises(AttributeError):
        captum_vit.no_such_name  # noqa: B018


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


# -- errors that name the fix -----------------------------------------------------------------
def test_grayscale_inputs_error_names_the_fix():
    model = make_model()
    gray = make_inputs(batch=1)[:, :1]
    with pytest.raises(ValueError) as info:
        GAE(model).attribute(gray)
    message = str(info.value)
    assert "1 channel (grayscale)" in message and "expects 3 channels" in message
    assert "expand(-1, 3, -1, -1)" in message and "repeat(1, 3, 1, 1)" in message
    assert "1-channel" in message
    GAE(model).attribute(gray.expand(-1, 3, -1, -1))  # the fix works


def test_tokentm_variant_is_case_insensitive():
    model = make_model()
    assert TokenTM(model, variant="Paper").variant == "paper"
    assert TokenTM(model, variant="RESIDUAL").variant == "residual"
    x = make_inputs(batch=1)
    torch.testing.assert_close(TokenTM(model, variant="Residual").attribute(x, output="tokens"),
                               TokenTM(model, variant="residual").attribute(x, output="tokens"))
    with pytest.raises(ValueError, match="variant must be one of"):
        TokenTM(model, variant="papers")


def test_wrapper_hint_is_valid_python():
    vit = make_model()
    for wrapper, path in [
        (nn.Sequential(nn.Identity(), vit), "model[1]"),
        (nn.Sequential(nn.ModuleDict({"back-bone": nn.Sequential(vit)})),
         "model[0]['back-bone'][0]"),
    ]:
        with pytest.raises(TypeError) as info:
            GAE(wrapper)
        message = str(info.value)
        assert f"`{path}`" in message and f"GAE({path})" in message
        assert eval(path, {"model": wrapper}) is vit  # noqa: S307 - the hint runs as written


class BatchFeature(UserDict):
    """Stands in for transformers' BatchFeature (a UserDict of tensors)."""


@pytest.mark.parametrize("inputs,fix", [
    (np.zeros((1, 3, 32, 32), np.float32), "torch.from_numpy"),
    (Image.new("RGB", (32, 32)), "preprocess"),
    ([torch.zeros(3, 32, 32), torch.zeros(3, 32, 32)], "torch.stack"),
    # a processor's output stands for its pixel_values (checked as such)
    (BatchFeature(pixel_values=np.zeros((1, 3, 32, 32), np.float32)), "torch.from_numpy"),
    ({"images": torch.zeros(1, 3, 32, 32)}, "the image tensor [B, C, H, W] it holds"),
    ([[0.0]], "[B, C, H, W]"),
])
def test_non_tensor_inputs_get_a_type_error_with_the_fix(inputs, fix):
    with pytest.raises(TypeError, match="inputs must be a torch.Tensor") as info:
        GAE(make_model()).attribute(inputs)
    assert fix in str(info.value)
