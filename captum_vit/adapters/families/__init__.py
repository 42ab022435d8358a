# isort: skip_file
"""The model families: one file each, registered beside its adapter class with
:func:`~captum_vit.adapters.catalog.register_family`.

This import list is the only list of families: its order is the dispatch order of
:func:`~captum_vit.adapters.adapt` (the first family whose predicate accepts a model
explains it). A new family is its file plus one line here. The private modules hold what
several families read: ``_torch`` (PyTorch's own modules), ``_timm``, ``_hf`` (timm's and
Hugging Face's), ``_examples`` (the example builders' shared parts); no family imports
another family.
"""

# The order of these lines is the dispatch order (no import sorting: isort: skip_file).
from captum_vit.adapters.families import timm_vit  # noqa: F401
from captum_vit.adapters.families import timm_beit  # noqa: F401
from captum_vit.adapters.families import timm_eva  # noqa: F401
from captum_vit.adapters.families import timm_naflex  # noqa: F401
from captum_vit.adapters.families import hf_vit  # noqa: F401
from captum_vit.adapters.families import hf_siglip2  # noqa: F401
from captum_vit.adapters.families import hf_clip  # noqa: F401
from captum_vit.adapters.families import hf_idefics3  # noqa: F401
from captum_vit.adapters.families import hf_qwen_vl  # noqa: F401
from captum_vit.adapters.families import hf_beit  # noqa: F401
from captum_vit.adapters.families import hf_backbone  # noqa: F401
from captum_vit.adapters.families import hf_yolos  # noqa: F401
from captum_vit.adapters.families import hf_dinov3  # noqa: F401
from captum_vit.adapters.families import hf_internvl  # noqa: F401
from captum_vit.adapters.families import torchvision_vit  # noqa: F401
from captum_vit.adapters.families import open_clip  # noqa: F401
from captum_vit.adapters.families import hf_timesformer  # noqa: F401
from captum_vit.adapters.families import hf_videomae  # noqa: F401
from captum_vit.adapters.families import hf_vivit  # noqa: F401
from captum_vit.adapters.families import hf_vjepa2  # noqa: F401
from captum_vit.adapters.families import swin_v2  # noqa: F401
from captum_vit.adapters.families import swin  # noqa: F401
from captum_vit.adapters.families import sam  # noqa: F401
from captum_vit.adapters.families import hf_sam2  # noqa: F401
from captum_vit.adapters.families import hiera  # noqa: F401
