"""VanillaGrad and AttnGrad (SPEC_NEXT §8.1) against slow float64 references written here
from the spec (Grad-SAM, §8.4, shares the reference: tests/methods/test_gradsam.py).

The reference runs timm's OWN forward on a deep copy with eager attention, keeping every
block input ``x_l``, the last block output ``x_L`` and every attention probability
``A_l^h`` (forward hooks); the attention-pool head of ``global_pool='map'`` is re-computed
by hand from its modules so that its probabilities ``A_p`` are kept too. The score's
gradients come from ``backward()`` on the model's own logits, and each method's formula is
applied to the full tensors with the readout weights of SPEC_NEXT §7.0/§7.3 (``e_0`` for a
class token, uniform over patch rows for average pooling, ``mean_h ReLU(∇A_p ⊙ A_p)[0]``
for an attention pool).
"""

from __future__ import annotations

import copy

import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.methods.gradsam import GradSAM
from captum_vit.methods.ixg import layer_gradients
from captum_vit.methods.vanilla import AttnGrad, VanillaGrad
from tests.helpers import make_inputs, make_model, needs_transformers

FAMILIES = ["vit", "map", "beit"]  # class token, attention pool, avg pool + rel-pos bias
ATOL = 1e-10


class Reference:
    """timm's own forward (eager attention) on a copy, every tensor of the spec kept."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = copy.deepcopy(model)
        self.attn: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []
        self.pool_attn: torch.Tensor | None = None
        blocks = self.model.blocks
        for blk in blocks:
            blk.attn.fused_attn = False
            blk.attn.attn_drop.register_forward_hook(self._keep_attn)
            blk.register_forward_pre_hook(self._keep_input)
        blocks[-1].register_forward_hook(self._keep_output)
        if getattr(self.model, "attn_pool", None) is not None:
            self.model.attn_pool.forward = self._pool

    def _keep_attn(self, module, args, out):
        out.retain_grad()
        self.attn.append(out)

    def _keep_input(self, module, args):
        args[0].retain_grad()
        self.states.append(args[0])

    def _keep_output(self, module, args, out):
        out.retain_grad()
        self.states.append(out)

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        """timm ``AttentionPoolLatent`` (Q = 1, no pos_embed, no q/k norm), by hand."""
        p = self.model.attn_pool
        b, n, d = x.shape
        q = p.q(p.latent.expand(b, -1, -1)).reshape(b, 1, p.num_heads, p.head_dim)
        q = q.transpose(1, 2)
        k, v = p.kv(x).reshape(b, n, 2, p.num_heads, p.head_dim).permute(2, 0, 3, 1, 4)
        a = ((q * p.scale) @ k.transpose(-2, -1)).softmax(-1)  # [B, H, 1, n]
        a.retain_grad()
        self.pool_attn = a
        o = p.proj((a @ v).transpose(1, 2).reshape(b, 1, d))
        return (o + p.mlp(p.norm(o)))[:, 0]

    def run(self, x: torch.Tensor, target: torch.Tensor, score: str = "logit") -> None:
        self.attn.clear()
        self.states.clear()
        logits = self.model(x)
        s = logits.softmax(-1) if score == "probability" else logits
        s.gather(1, target[:, None]).sum().backward()

    def weights(self) -> torch.Tensor:
        """Readout weights ``w`` [B, N] (SPEC_NEXT §7.0, §7.3), gradient-weighted pool."""
        m = self.model
        b, n = self.states[0].shape[:2]
        k = m.num_prefix_tokens
        if self.pool_attn is not None:
            assert self.pool_attn.shape[-1] == n  # the pool reads every token here
            return (self.pool_attn.grad * self.pool_attn.detach()).clamp(min=0).mean(1)[:, 0]
        w = torch.zeros(b, n, dtype=self.states[0].dtype)
        if m.global_pool == "avg":
            w[:, k:] = 1.0 / (n - k)
        else:
            assert m.global_pool == "token"
            w[:, 0] = 1.0
        return w


def reduce_ref(g: torch.Tensor, reduce: str) -> torch.Tensor:
    out = torch.zeros(g.shape[:2], dtype=g.dtype)
    for c in range(g.shape[-1]):  # a plain loop over channels
        gc = g[..., c]
        out += {"sum": gc, "l1": gc.abs(), "relu_sum": gc.clamp(min=0), "l2": gc * gc}[reduce]
    return out.sqrt() if reduce == "l2" else out


def attn_grad_ref(ref: Reference, layer: int, variant: str) -> torch.Tensor:
    g = ref.attn[layer].grad
    f = {"plain": lambda t: t, "abs": torch.abs, "relu": lambda t: t.clamp(min=0)}[variant]
    heads = g.shape[1]
    mat = sum(f(g[:, h]) for h in range(heads)) / heads  # [B, N, N]
    return torch.einsum("bi,bij->bj", ref.weights(), mat)


def gradsam_ref(ref: Reference, layers) -> torch.Tensor:
    w = ref.weights()
    out = torch.zeros_like(w)
    for l in layers:
        a, g = ref.attn[l].detach(), ref.attn[l].grad
        heads = a.shape[1]
        abar = sum((a[:, h] * g[:, h].clamp(min=0)) for h in range(heads)) / heads  # Barkan
        out += torch.einsum("bi,bij->bj", w, abar)
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    family = request.param
    model = make_model(family)
    x = make_inputs(family, batch=2)
    target = torch.tensor([1, 3])
    ref = Reference(model)
    ref.run(x, target)
    assert len(ref.attn) == len(ref.states) - 1 == len(model.blocks)
    return model, x, target, ref, adapt(model).num_prefix


@pytest.mark.parametrize("reduce", ["sum", "l2", "l1", "relu_sum"])
@pytest.mark.parametrize("layer", [0, 1, 3])
def test_vanilla_grad_matches_reference(case, layer, reduce):
    model, x, t, ref, k = case
    got = VanillaGrad(model, layer=layer, reduce=reduce).attribute(x, t, output="tokens")
    want = reduce_ref(ref.states[layer].grad, reduce)[:, k:]
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("variant", ["plain", "abs", "relu"])
@pytest.mark.parametrize("layer", [None, 0])
def test_attn_grad_matches_reference(case, layer, variant):
    model, x, t, ref, k = case
    got = AttnGrad(model, layer=layer, variant=variant).attribute(x, t, output="tokens")
    want = attn_grad_ref(ref, len(model.blocks) - 1 if layer is None else layer, variant)
    torch.testing.assert_close(got, want[:, k:], rtol=0, atol=ATOL)


def test_probability_score_matches_reference(case):
    model, x, t, _, k = case
    ref = Reference(model)
    ref.run(x, t, score="probability")
    got = VanillaGrad(model, layer=2).attribute(x, t, score="probability", output="tokens")
    torch.testing.assert_close(got, ref.states[2].grad.sum(-1)[:, k:], rtol=0, atol=ATOL)
    got = AttnGrad(model).attribute(x, t, score="probability", output="tokens")
    torch.testing.assert_close(got, attn_grad_ref(ref, 2, "plain")[:, k:], rtol=0, atol=ATOL)
    got = GradSAM(model).attribute(x, t, score="probability", output="tokens")
    torch.testing.assert_close(got, gradsam_ref(ref, range(3))[:, k:], rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", ["vit", "beit", "hf_vit"])
def test_vanilla_grad_sum_is_the_layer_gradient_sum(family):
    if family == "hf_vit":
        pytest.importorskip("transformers")
    model, x = make_model(family), make_inputs(family, batch=2)
    a = adapt(model)
    t = torch.tensor([0, 4])
    lg = layer_gradients(a, x, t)
    for l in range(a.num_blocks + 1):
        got = VanillaGrad(model, layer=l).attribute(x, t, output="tokens")
        torch.testing.assert_close(got, lg.grads[l].sum(-1)[:, a.num_prefix:], rtol=0,
                                   atol=ATOL)


@needs_transformers
def test_vanilla_grad_hf_matches_the_models_own_hidden_states():
    """Hugging Face ViT: gradients of the model's own ``hidden_states`` (SDPA, float64)."""
    model, x = make_model("hf_vit"), make_inputs("hf_vit", batch=2)
    t = torch.tensor([2, 0])
    out = copy.deepcopy(model)(pixel_values=x, output_hidden_states=True)
    for h in out.hidden_states:
        h.retain_grad()
    out.logits.gather(1, t[:, None]).sum().backward()
    for l, h in enumerate(out.hidden_states):  # x_0 .. x_L
        for reduce in ("sum", "l2"):
            got = VanillaGrad(model, layer=l, reduce=reduce).attribute(x, t, output="tokens")
            torch.testing.assert_close(got, reduce_ref(h.grad, reduce)[:, 1:], rtol=0,
                                       atol=ATOL)


@pytest.mark.parametrize("make", [
    lambda m: VanillaGrad(m, layer=1, reduce="l2"),
    lambda m: AttnGrad(m, layer=1, variant="relu"),
    lambda m: GradSAM(m),
])
def test_batch_equals_images_one_by_one(make):
    model, x = make_model("map"), make_inputs("map", batch=3)
    t = torch.tensor([0, 3, 2])
    method = make(model)
    batch = method.attribute(x, t, output="grid")
    for i in range(3):
        one = method.attribute(x[i:i + 1], int(t[i]), output="grid")
        torch.testing.assert_close(batch[i:i + 1], one, rtol=0, atol=ATOL)
    none = method.attribute(x, None, output="grid")  # None -> the predicted classes
    pred = model(x).argmax(-1)
    torch.testing.assert_close(none, method.attribute(x, pred, output="grid"), rtol=0,
                               atol=0)


def test_outputs_shapes_and_dtype():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    for method in (VanillaGrad(model), AttnGrad(model), GradSAM(model)):
        pix = method.attribute(x, 1)
        assert pix.shape == x.shape and pix.dtype == torch.float64
        (tup,) = method.attribute((x,), 1, output="grid")
        assert tup.shape == (2, 1, 4, 4)
    assert (GradSAM(model).attribute(x, 1, output="tokens") >= 0).all()


def test_bad_options_name_the_argument():
    model = make_model("vit")  # 3 blocks
    x = make_inputs("vit", batch=1)
    with pytest.raises(ValueError, match="reduce"):
        VanillaGrad(model, reduce="max")
    with pytest.raises(ValueError, match="layer"):
        VanillaGrad(model, layer=4)
    with pytest.raises(TypeError, match="layer"):
        VanillaGrad(model, layer=1.0)
    assert VanillaGrad(model, layer=3).layer == 3  # x_L is allowed
    with pytest.raises(ValueError, match="variant"):
        AttnGrad(model, variant="square")
    with pytest.raises(ValueError, match="layer"):
        AttnGrad(model, layer=3)
    with pytest.raises(ValueError, match="layer"):
        AttnGrad(model, layer=-1)
    with pytest.raises(TypeError, match="layer"):
        AttnGrad(model, layer="last")
    assert AttnGrad(model).layer == 2
    with pytest.raises(ValueError, match="layers"):
        GradSAM(model, layers=[])
    with pytest.raises(ValueError, match="layers"):
        GradSAM(model, layers=[0, 3])
    with pytest.raises(ValueError, match="layers"):
        GradSAM(model, layers=[1, 1])
    with pytest.raises(TypeError, match="layers"):
        GradSAM(model, layers=2)
    with pytest.raises(TypeError, match="average"):
        GradSAM(model, average=1)
    assert GradSAM(model, layers=range(2, 0, -1)).layers == (1, 2)
    for method in (VanillaGrad(model), AttnGrad(model), GradSAM(model)):
        with pytest.raises(ValueError, match="score"):
            method.attribute(x, 0, score="prob")
        with pytest.raises(ValueError, match="output"):
            method.attribute(x, 0, output="image")
        with pytest.raises(ValueError, match="target"):
            method.attribute(x, 7)
