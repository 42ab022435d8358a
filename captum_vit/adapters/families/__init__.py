"""The model families: one file each, registered beside its adapter class with
:func:`~captum_vit.adapters.catalog.register_family`.

This import list is the only list of families: its order is the dispatch order of
:func:`~captum_vit.adapters.adapt` (the first family whose predicate accepts a model
explains it). A new family is its file plus one line here. The private modules hold what
several families read: ``_torch`` (PyTorch's own modules), ``_timm``, ``_hf`` (timm's and
Hugging Face's), ``_examples`` (the example builders' shared parts); no family imports
another family.
"""

# isort: off  (the order is the dispatch order)
from captum_vit.adapters.families import (
    hf_backbone,  # noqa: F401
    hf_beit,  # noqa: F401
    hf_clip,  # noqa: F401
    hf_videomae,  # noqa: F401
    hf_vit,  # noqa: F401
    hf_yolos,  # noqa: F401
    open_clip,  # noqa: F401
    sam,  # noqa: F401
    swin,  # noqa: F401
    timm_beit,  # noqa: F401
    timm_eva,  # noqa: F401
    timm_vit,  # noqa: F401
    torchvision_vit,  # noqa: F401
)
# isort: on
