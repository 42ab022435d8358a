"""The ``captum-vit explain`` figure: near-zero maps drawn flat and marked, panels grouped
by method kind, the settings said on the figure and in ``--help``, ``--full``,
``--n-masks`` and ``--tolerance``."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from captum_vit import viz  # noqa: E402
from captum_vit.cli import main  # noqa: E402
from captum_vit.commands import explain  # noqa: E402
from captum_vit.registry import (  # noqa: E402
    KINDS,
    METHODS,
    available_methods,
    method_kind,
    quick_options,
)
from captum_vit.viz import NEAR_ZERO_NOTE, near_zero, plot_grid  # noqa: E402


def _texts(ax) -> str:
    return " ".join(t.get_text() for t in ax.texts)


def _panels(fig) -> dict:
    """title -> axis of every panel with a title."""
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def test_near_zero_rule_uses_the_reference_and_the_largest_map():
    g = torch.Generator().manual_seed(0)
    maps = {"gae": torch.rand(2, 16, generator=g), "grad": 1e-9 * torch.randn(2, 16, generator=g),
            "small": 1e-4 * torch.rand(2, 16, generator=g)}
    maps["grad"][1] = 0.0
    flags = near_zero(maps, reference=4.0)
    assert flags["grad"].tolist() == [True, True]
    assert flags["gae"].tolist() == [False, False] and flags["small"].tolist() == [False, False]
    # without a reference the largest map sets the scale; per image
    alone = near_zero({"a": torch.tensor([[1e-9, 0.0], [1.0, 0.5]]),
                       "b": torch.tensor([[2.0, 1.0], [1e-3, 0.0]])})
    assert alone["a"].tolist() == [True, False] and alone["b"].tolist() == [False, False]
    # a per-image reference; rtol=0 flags exact zeros only
    per_image = near_zero({"m": torch.full((2, 4), 1e-8)}, reference=torch.tensor([1.0, 1e-3]))
    assert per_image["m"].tolist() == [True, False]
    assert near_zero(maps, reference=4.0, rtol=0)["grad"].tolist() == [False, True]


def test_grid_draws_a_near_zero_map_flat_and_marks_it():
    g = torch.Generator().manual_seed(1)
    maps = {"gae": torch.rand(1, 64, generator=g), "vanilla_grad": 1e-9 * torch.randn(1, 64)}
    fig = plot_grid(torch.rand(1, 1, 56, 56), maps, reference=3.0)
    panels = _panels(fig)
    flat, real = panels["vanilla_grad"], panels["gae"]
    assert NEAR_ZERO_NOTE in _texts(flat) and "e-" in _texts(flat)
    assert len(flat.images) == 1  # the faded image only, no heat map, no colour bar
    assert NEAR_ZERO_NOTE not in _texts(real) and len(real.images) == 2
    plt.close(fig)
    # several images: only the image whose map is zero is drawn flat
    two = {"gae": torch.rand(2, 64, generator=g), "grad": torch.stack([1e-9 * torch.ones(64),
                                                                      torch.rand(64)])}
    fig = plot_grid(torch.rand(2, 1, 56, 56), two, reference=3.0)
    marked = [NEAR_ZERO_NOTE in _texts(ax) for ax in fig.axes if ax.get_title() == "grad"]
    assert marked == [True, False]
    plt.close(fig)


def test_grid_groups_panels_and_starts_each_group_on_a_new_row():
    g = torch.Generator().manual_seed(2)
    names = ["gae", "rollout", "gradcam", "tokentm", "hirescam", "layercam"]
    maps = {n: torch.rand(1, 64, generator=g) for n in names}
    groups = {n: KINDS[method_kind(n)] for n in names}
    fig = plot_grid(torch.rand(1, 1, 56, 56), maps, groups=groups, max_cols=2, note="footnote")
    cols = fig.axes[0].get_gridspec().get_geometry()[1]
    where = {ax.get_title(): divmod(ax.get_subplotspec().num1, cols) for ax in fig.axes
             if ax.get_title() in maps}
    # groups in order of first appearance: gradient x attention, attention, CAM
    assert where["gae"] == (1, 0) and where["tokentm"] == (1, 1)
    assert where["rollout"] == (2, 0)
    assert where["gradcam"] == (3, 0) and where["hirescam"] == (3, 1)
    assert where["layercam"] == (4, 0)
    labels = [t.get_text() for t in fig.texts]
    for label in ("gradient × attention", "attention & rollout", "CAM on tokens", "footnote"):
        assert label in labels
    plt.close(fig)


def test_every_registered_method_has_a_kind():
    for e in METHODS:
        assert e.kind in KINDS, e.name
    assert method_kind("SkipPLUS(DecompX)") == "composition"
    assert method_kind("captum:Saliency") == "captum"
    assert {method_kind(n) for n in ("vanilla_grad", "hirescam", "rollout", "rise",
                                       "attnlrp")} == {"gradient", "cam", "attention",
                                                       "perturbation", "decomposition"}
    with pytest.raises(ValueError, match="kind"):
        type(METHODS[0])("x", object, lambda m, s: None, kind="nope")


def test_explain_groups_by_kind_flattens_zero_maps_and_notes_the_settings(tmp_path, capsys,
                                                                            monkeypatch):
    seen = {}
    real = viz.plot_grid

    def spy(images, maps, **kwargs):
        seen.update(kwargs, maps=maps, fig=real(images, maps, **kwargs))
        return seen["fig"]

    monkeypatch.setattr(viz, "plot_grid", spy)
    out = tmp_path / "maps.png"
    argv = ["explain", "--model", "random:vit_tiny", "--methods",
            "vanilla_grad,gradcam,gae,rollout,tis", "--out", str(out)]
    assert main(argv) == 0
    order = list(seen["maps"])
    assert order == ["rollout", "gae", "vanilla_grad", "gradcam", "tis"]  # by method kind
    assert seen["groups"]["rollout"] == KINDS["attention"]
    assert seen["groups"]["gradcam"] == KINDS["cam"]
    assert "tis n_masks=128 (API default 1024)" in seen["note"] and "--full" in seen["note"]
    assert seen["reference"] > 0
    panels = _panels(seen["fig"])
    assert NEAR_ZERO_NOTE in _texts(panels["vanilla_grad"])
    assert NEAR_ZERO_NOTE not in _texts(panels["gae"])
    assert "tis n_masks=128" in " ".join(t.get_text() for t in seen["fig"].texts)
    assert "vanilla_grad's map is numerically zero" in capsys.readouterr().err


def test_explain_full_n_masks_and_tolerance_reach_the_methods(tmp_path, monkeypatch, capsys):
    calls = {}
    real = explain.build_method

    def spy(name, model, **kw):
        method = real(name, model, **kw)
        attribute = method.attribute

        def recording(*args, **kwargs):
            calls[name] = {k: v for k, v in kwargs.items() if k not in ("target", "output")}
            return attribute(*args, **kwargs)

        method.attribute = recording
        return method

    monkeypatch.setattr(explain, "build_method", spy)
    base = ["explain", "--model", "random:vit_tiny", "--methods", "tis,rise,bt_h,gae"]
    assert main(base + ["--n-masks", "16", "--tolerance", "0.9",
                        "--out", str(tmp_path / "a.png")]) == 0
    assert calls["tis"] == {"n_masks": 16, "tolerance": 0.9}
    assert calls["rise"] == {"n_masks": 16}
    assert calls["bt_h"] == quick_options("bt_h") and calls["gae"] == {}
    calls.clear()
    assert main(base[:-1] + ["tis,bt_h,gae", "--full", "--n-masks", "32",
                             "--out", str(tmp_path / "b.png")]) == 0
    assert calls == {"tis": {"n_masks": 32}, "bt_h": {}, "gae": {}}
    capsys.readouterr()
    assert main(base + ["--tolerance", "1.5", "--out", str(tmp_path / "c.png")]) == 2
    assert "--tolerance must be in (0, 1]" in capsys.readouterr().err


def test_explain_help_tells_the_quick_settings_and_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in available_methods():
        for option, value in quick_options(name).items():
            assert f"{option}={value}" in text
    assert "n_masks=128 (API default 1024)" in text and "n_masks=500 (API default 4000)" in text
    for option in ("--full", "--n-masks", "--tolerance"):
        assert option in text


def test_the_near_zero_panel_says_what_was_measured():
    """Issue 42: the panel blamed the method ("structurally near zero"); it says what was
    measured: the map's peak next to the scores' scale, on this input."""
    assert "structurally" not in NEAR_ZERO_NOTE and "this input" in NEAR_ZERO_NOTE
    maps = {"gae": torch.rand(1, 64), "sam": torch.full((1, 64), 3e-26)}
    fig = plot_grid(torch.rand(1, 3, 32, 32), maps, reference=2.5)
    text = _texts(_panels(fig)["sam"])
    assert NEAR_ZERO_NOTE in text and "3.0e-26" in text
    assert "next to 2.5e+00, the largest score or map" in " ".join(text.split())
    plt.close(fig)


def test_grid_draws_a_refused_method_with_its_message():
    g = torch.Generator().manual_seed(3)
    maps = {"gae": torch.rand(1, 64, generator=g), "rollout": torch.rand(1, 64, generator=g)}
    message = ("ValueError: TIS removes tokens, which breaks the window partition of this "
               "Swin; use RISE or ViT-CX")
    groups = {"gae": "a", "tis": "b", "rollout": "a"}
    fig = plot_grid(torch.rand(1, 1, 56, 56), maps, refused={"tis": message}, groups=groups)
    panels = _panels(fig)
    assert set(panels) >= {"gae", "rollout", "tis"}
    text = " ".join(_texts(panels["tis"]).split())
    assert text.startswith(viz.REFUSED_NOTE) and "use RISE or ViT-CX" in text
    assert len(panels["tis"].images) == 1  # the faded input, no map
    assert viz.REFUSED_NOTE not in _texts(panels["gae"])
    plt.close(fig)
    # several images: a refused panel on every row
    fig = plot_grid(torch.rand(2, 1, 56, 56), {"gae": torch.rand(2, 64)}, refused={"tis": "x"})
    assert sum(ax.get_title() == "tis" for ax in fig.axes) == 2
    plt.close(fig)
    with pytest.raises(ValueError, match="refused names methods that have a map"):
        plot_grid(torch.rand(1, 1, 56, 56), maps, refused={"gae": "no"})


def _refusing(monkeypatch, refuse):
    """``explain.build_method`` whose methods in ``refuse`` raise a ValueError."""
    real = explain.build_method

    def build(name, model, **kw):
        method = real(name, model, **kw)
        if name in refuse:
            def attribute(*args, **kwargs):
                raise ValueError(f"{name} refuses this model (a test): use gae instead")

            method.attribute = attribute
        return method

    monkeypatch.setattr(explain, "build_method", build)


def test_explain_writes_the_figure_when_one_method_refuses(tmp_path, capsys, monkeypatch):
    """Issue 42: on a Swin with ``tis`` in the list, ``explain`` wrote no figure and threw
    away the finished maps; the refusal now has its panel."""
    seen = {}
    real = viz.plot_grid

    def spy(images, maps, **kwargs):
        seen.update(kwargs, maps=maps, fig=real(images, maps, **kwargs))
        return seen["fig"]

    monkeypatch.setattr(viz, "plot_grid", spy)
    _refusing(monkeypatch, {"tis"})
    out = tmp_path / "maps.png"
    assert main(["explain", "--model", "random:vit_tiny", "--methods", "gae,tis,rollout",
                 "--n-masks", "8", "--out", str(out)]) == 0
    assert out.is_file() and out.stat().st_size > 0
    assert set(seen["maps"]) == {"gae", "rollout"}
    assert set(seen["refused"]) == {"tis"} and "use gae instead" in seen["refused"]["tis"]
    panel = " ".join(_texts(_panels(seen["fig"])["tis"]).split())
    assert viz.REFUSED_NOTE in panel and "tis refuses this model" in panel
    captured = capsys.readouterr()
    assert "note: tis refused" in captured.err
    assert "2 methods (1 more refused)" in captured.out


def test_explain_fails_when_every_method_refuses(tmp_path, capsys, monkeypatch):
    _refusing(monkeypatch, {"gae", "rollout"})
    out = tmp_path / "maps.png"
    assert main(["explain", "--model", "random:vit_tiny", "--methods", "gae,rollout",
                 "--out", str(out)]) != 0
    assert not out.exists()
    assert "rollout refuses this model" in capsys.readouterr().err  # the first (by method kind)


def test_explain_on_a_swin_with_tis_draws_the_refusal(tmp_path, capsys):
    """The case of issue 42 itself: TIS refuses a Swin by name; GAE's map is kept and the
    figure written, TIS's panel holding its message."""
    out = tmp_path / "swin.png"
    assert main(["explain", "--model", "timm:swin_tiny_patch4_window7_224", "--methods",
                 "gae,tis", "--n-masks", "8", "--out", str(out)]) == 0
    assert out.is_file()
    captured = capsys.readouterr()
    assert "1 method (1 more refused)" in captured.out
    assert "note: tis refused" in captured.err and "window" in captured.err
