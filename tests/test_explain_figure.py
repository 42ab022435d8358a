"""The ``captum-vit explain`` figure: near-zero maps drawn flat and marked, panels grouped
by method family, the settings said on the figure and in ``--help``, ``--full``,
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
    FAMILIES,
    METHODS,
    available_methods,
    method_family,
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
    groups = {n: FAMILIES[method_family(n)] for n in names}
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


def test_every_registered_method_has_a_family():
    for e in METHODS:
        assert e.family in FAMILIES, e.name
    assert method_family("SkipPLUS(DecompX)") == "composition"
    assert method_family("captum:Saliency") == "captum"
    assert {method_family(n) for n in ("vanilla_grad", "hirescam", "rollout", "rise",
                                       "attnlrp")} == {"gradient", "cam", "attention",
                                                       "perturbation", "decomposition"}
    with pytest.raises(ValueError, match="family"):
        type(METHODS[0])("x", object, lambda m, s: None, family="nope")


def test_explain_groups_by_family_flattens_zero_maps_and_notes_the_settings(tmp_path, capsys,
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
    assert order == ["rollout", "gae", "vanilla_grad", "gradcam", "tis"]  # by family
    assert seen["groups"]["rollout"] == FAMILIES["attention"]
    assert seen["groups"]["gradcam"] == FAMILIES["cam"]
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
