"""The package's lazy exports: every name of ``captum_vit.__all__`` resolves, ``dir()`` lists
them, and an unknown name raises AttributeError."""

from __future__ import annotations

import pytest


def test_lazy_package_exports_every_public_name():
    import captum_vit

    for name in captum_vit.__all__:
        assert getattr(captum_vit, name) is not None
    assert "GAE" in dir(captum_vit)
    with pytest.raises(AttributeError):
        captum_vit.no_such_name  # noqa: B018
