"""Adapter for the vision towers of Hugging Face Idefics3 and SmolVLM:
``Idefics3VisionTransformer`` and ``SmolVLMVisionTransformer`` (``model.model.vision_model``
of ``Idefics3ForConditionalGeneration`` / ``SmolVLMForConditionalGeneration``).

Verified in the installed transformers (``modeling_idefics3.py``; SmolVLM's is the same
code under other names): the tower is SigLIP's (no prefix token, pre-LN layers
``layer_norm1`` / ``self_attn.{q,k,v,out}_proj`` / ``layer_norm2`` / ``mlp.fc{1,2}``,
tanh-GELU MLPs, ``post_layernorm`` on every token, no pooling head) with another
embedding: ``Idefics3VisionEmbeddings(pixel_values, patch_attention_mask)`` adds the
position embedding of each patch's bucket ``⌊i · n / h⌋`` on the ``n × n`` table
(``n = image_size / patch_size``) for a grid of ``h × w`` real patches (NaViT's
fractional coordinates): at the configured size the positions are the table's own, at
other sizes each patch reads its bucket (no interpolation). The patch attention mask
marks padded patches of a padded image; the processors of both VLMs give every real tile
the full ``image_size`` square (tiles and the global image are resized to it, only
whole padding images are zero), so the adapter runs the tower with every patch real (the
tower's own default, ``patch_attention_mask=None``).

The tower has no embedding of its own: the patch mean of its final-normed tokens stands
for one (our choice, as for PaliGemma's head-less SigLIP tower), so it is explained with
vector targets; :class:`~captum_vit.targets.VLMAnswer` reads the final-normed tokens
themselves (the pixel-shuffle connector then runs as the VLM does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, randomize_
from captum_vit.adapters.families._hf import HFViTBase, encoder_blocks, is_transformers_model
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import HeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("Idefics3VisionTransformer", "SmolVLMVisionTransformer")


def is_hf_idefics3_tower(model: nn.Module) -> bool:
    """``True`` for the Hugging Face vision towers in :data:`CLASSES`."""
    return is_transformers_model(model, CLASSES)


def _tower(cls_name: str) -> Any:
    """A builder of a small tower ``cls_name`` (32 px, patch 8, width 32, 4 heads)."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5) -> nn.Module:
        transformers = library("transformers")
        cfg = getattr(transformers, cls_name.replace("Transformer", "Config"))(
            hidden_size=32, intermediate_size=64, num_hidden_layers=depth,
            num_attention_heads=4, image_size=32, patch_size=8, layer_norm_eps=1e-6)
        torch.manual_seed(seed)
        model = getattr(transformers, cls_name)(cfg)
        return randomize_(model, seed).to(dtype).eval()

    return build


@register_family(
    is_hf_idefics3_tower,
    name="hf_idefics3",
    supports="Hugging Face Idefics3VisionTransformer, SmolVLMVisionTransformer (the towers "
             "of Idefics3 / SmolVLM)",
    tags=("embedding", "vlm-tower", "variable-size"),
    notes=("`Idefics3VisionTransformer` / `SmolVLMVisionTransformer` (SigLIP layers, NaViT "
           "bucketed positions, no head: the patch mean of the final-normed tokens stands for "
           "an embedding); the towers of `Idefics3ForConditionalGeneration` and "
           "`SmolVLMForConditionalGeneration` with `VLMAnswer` on their tiles: ✅ (forward "
           "equals the model's 1e-12; maps equal a SigLIP twin's with copied weights, every "
           "method, 1e-10)"),
    examples={
        "hf_idefics3": Example(_tower("Idefics3VisionTransformer"), (32, 32),
                               library="transformers", target="embedding"),
        "hf_smolvlm_tower": Example(_tower("SmolVLMVisionTransformer"), (32, 32),
                                    library="transformers", target="embedding",
                                    tags=("matrix",), suite=False),
    })
class HFIdefics3TowerAdapter(HFViTBase):
    """Canonical view of an Idefics3 / SmolVLM vision tower (never modified).

    Its output is the patch mean of the final-normed tokens (:attr:`embedding` is
    ``True``): explain it with a vector target, or the whole VLM's answer with
    :class:`~captum_vit.targets.VLMAnswer` on the real tiles
    (``VLMAnswer.images(batch)``).
    """

    embedding = True

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        self.backbone = model
        cfg = self.config
        self.layers = model.encoder.layers
        self.blocks = encoder_blocks(self.layers, cfg, name)
        self.in_chans = int(cfg.num_channels)
        self.num_prefix = 0
        self.interpolates = True
        self.readout = "avg"
        self.head = HeadParts(_norm(model.post_layernorm, f"{name}.post_layernorm"), None,
                              (("avg", None, None),))

    def refresh(self) -> None:
        """Nothing is sliced: the parts are the model's own parameters."""

    def _full_mask(self, inputs: Tensor) -> Tensor:
        """Every patch real: ``[n, h / p, w / p]`` ones (the tower's default)."""
        p = int(self.config.patch_size)
        return torch.ones(inputs.shape[0], inputs.shape[-2] // p, inputs.shape[-1] // p,
                          dtype=torch.bool, device=inputs.device)

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeddings(pixel_values, patch_attention_mask)`` with every
        patch real; with ``ops`` the patch projection runs as ``ops.linear`` of the
        unfolded patches, added as ``p - p.detach()`` (exactly 0) to the model's
        embedding of the detached images."""
        emb = self.model.embeddings
        if ops is None:
            return emb(inputs, self._full_mask(inputs))
        x = emb(inputs.detach(), self._full_mask(inputs))
        p = patch_projection(inputs, emb.patch_embedding, ops,
                             f"{type(self.model).__name__}.embeddings patch projection")
        p = p.flatten(1, 2)
        return x + (p - p.detach())

    def embedding_norms(self) -> tuple[str, ...]:
        return ()

    def model_outputs(self, inputs: Tensor) -> Tensor:
        return self.model(pixel_values=inputs).last_hidden_state.mean(1)

    def is_random(self) -> bool:
        return bool(self.model.training) and getattr(self.config, "attention_dropout", 0) > 0

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        stages = [list(self.model.post_layernorm.parameters())]
        return stages + [list(layer.parameters()) for layer in reversed(self.layers)]
