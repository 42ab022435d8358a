"""Beyond Intuition BT-H / BT-T and TAM (SPEC_NEXT §8.8-8.9) against slow references written
from the spec: one image at a time, explicit loops over the integration steps and the
blocks, attention, its gradient, block inputs and value vectors grabbed from the model's OWN
modules (timm's forward with hooks, Hugging Face's eager attention), float64."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from captum_vit import BTH, BTT, PLUS, TAM, SkipPLUS
from captum_vit.adapters import adapt
from captum_vit.methods.bt import integrated_attention_gradient, reasoning_feedback
from tests.helpers import ReferenceCapture, family_marks, make_inputs, make_model

TARGETS = torch.tensor([1, 4, 0])
DEPTH = 4
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = make_model(family, depth=DEPTH)
    return _MODELS[family]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=tol * (1 + b.abs().max().item()))


# -- the model's own forward ----------------------------------------------------------------
class Capture:
    """One forward of the model's own code: logits, attention probabilities (gradients
    retained), block inputs x_l, value vectors v (bias included) and W_O of every block."""

    def __init__(self, model: torch.nn.Module, family: str, monkeypatch=None) -> None:
        self.hf = family.startswith("hf_")
        self.values: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor] = []
        if self.hf:
            # Hugging Face's eager attention takes its softmax in float32; the reference
            # keeps float64 (same formula, the probabilities returned and in the graph)
            import transformers.models.vit.modeling_vit as mv

            monkeypatch.setattr(mv, "eager_attention_forward", _eager_float64)
            self.model = copy.deepcopy(model)
            self.model.set_attn_implementation("eager")
            layers = self.model.vit.layers
            vs = [blk.attention.v_proj for blk in layers]
            self.wo = [blk.attention.o_proj.weight.detach() for blk in layers]
            for blk in layers:
                blk.register_forward_pre_hook(self._grab_input, with_kwargs=True)
        else:
            self.refs = ReferenceCapture(model)
            blocks = self.refs.model.blocks
            vs = [blk.attn.qkv for blk in blocks]
            self.wo = [blk.attn.proj.weight.detach() for blk in blocks]
        for mod in vs:
            mod.register_forward_hook(self._grab_value)

    def _grab_input(self, module, args, kwargs):
        self.inputs.append((args[0] if args else kwargs["hidden_states"]).detach())

    def _grab_value(self, module, args, out):
        d = self.wo[0].shape[0]
        self.values.append(out.detach()[..., -d:])  # timm's qkv: v is the last third

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.values.clear()
        self.inputs.clear()
        if self.hf:
            out = self.model(x, output_attentions=True)
            self.attn = list(out.attentions)
            for a in self.attn:
                a.retain_grad()
            return out.logits
        logits = self.refs(x)
        self.attn = self.refs.attn
        self.inputs = [z.detach() for z in self.refs.block_inputs]
        return logits


def _eager_float64(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   **kwargs):
    """Hugging Face's ``eager_attention_forward`` with the softmax in the inputs' dtype."""
    scores = (query @ key.transpose(2, 3)) * (scaling or query.shape[-1] ** -0.5)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = scores.softmax(-1)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def readout_weights(family: str, n: int) -> torch.Tensor:
    """w of the family: the class token, or the mean of the patch rows (no prefix)."""
    if family == "avgpool":
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    w = torch.zeros(n, dtype=torch.float64)
    w[0] = 1.0
    return w


def ref_feedback(cap: Capture, x1: torch.Tensor, t: int, n: int,
                 integrated: bool = True) -> torch.Tensor:
    """mean_h ReLU((1/n) Σ_k ∇A_{L-1}(α_k X)) [N, N], α = linspace(0, 1, n), one
    forward and backward per step (the authors' loop)."""
    if not integrated:
        cap(x1)[0, t].backward()
        return cap.attn[-1].grad[0].clamp(min=0).mean(0)
    total = 0
    for a in np.linspace(0, 1, n):
        cap(x1 * float(a))[0, t].backward()
        total = total + cap.attn[-1].grad[0]
    return (total / n).clamp(min=0).mean(0)


def ref_bt(cap, family, x1, t, *, variant, start, n):
    """BT-H / BT-T of one image [1, C, H, W] from the spec (full matrices R)."""
    W = ref_feedback(cap, x1, t, n)
    cap(x1)[0, t].backward()
    L, N = len(cap.attn), cap.attn[0].shape[-1]
    R = torch.eye(N, dtype=torch.float64)
    for l in range(start, L):
        A = cap.attn[l].detach()[0]
        if variant == "head":
            G = cap.attn[l].grad[0]
            ih = torch.stack([(A[h].T @ G[h]).abs().mean() for h in range(A.shape[0])])
            ih = ih / ih.sum()
            Ahat = sum(ih[h] * A[h] for h in range(A.shape[0]))
        else:
            vproj = cap.values[l][0] @ cap.wo[l].T
            o = vproj.norm(dim=-1) / cap.inputs[l][0].norm(dim=-1)
            Ahat = A.mean(0) @ torch.diag(o)
        R = R + Ahat @ R
    if variant == "token":
        R = R.abs()
    return readout_weights(family, N) @ (W * R)


def ref_tam(cap, family, x1, t, *, start, n, integrated=True):
    W = ref_feedback(cap, x1, t, n, integrated)
    cap(x1)
    L, N = len(cap.attn), cap.attn[0].shape[-1]
    w = readout_weights(family, N)
    state = w @ cap.attn[-1].detach()[0].mean(0)
    for i in reversed(range(start, L - 1)):
        state = state + state @ cap.attn[i].detach()[0].mean(0)
    return state * (w @ W)


FAMILIES = [pytest.param(f, marks=family_marks(f)) for f in ("vit", "avgpool", "hf_vit")]


@pytest.mark.parametrize("family", FAMILIES)
def test_against_the_spec_from_the_models_own_forward(family, monkeypatch):
    model, x = model_of(family), make_inputs(family)
    cap = Capture(model, family, monkeypatch)
    k = adapt(model).num_prefix
    n = 5
    cases = [
        (BTH(model, start_layer=1, n_steps=n),
         lambda x1, t: ref_bt(cap, family, x1, t, variant="head", start=1, n=n)),
        (BTT(model, start_layer=1, n_steps=n, internal_batch_size=4),
         lambda x1, t: ref_bt(cap, family, x1, t, variant="token", start=1, n=n)),
        (BTH(model, n_steps=3),  # the default start block 3: only the last block
         lambda x1, t: ref_bt(cap, family, x1, t, variant="head", start=3, n=3)),
        (TAM(model, start_layer=1, n_steps=n),
         lambda x1, t: ref_tam(cap, family, x1, t, start=1, n=n)),
        (TAM(model, start_layer=0, integrated=False),
         lambda x1, t: ref_tam(cap, family, x1, t, start=0, n=n, integrated=False)),
    ]
    for method, ref in cases:
        got = method.attribute(x, TARGETS, output="tokens")
        want = torch.stack([ref(x[i:i + 1], int(TARGETS[i])) for i in range(3)])
        close(got, want[:, k:])


def test_batches_chunks_and_defaults():
    """A batch equals its images one by one, for any internal_batch_size (chunks that cut
    through the steps); the integrated gradient with and without the caller's gradient at X."""
    model, x = model_of("vit"), make_inputs("vit")
    for cls in (BTH, BTT, TAM):
        base = cls(model, n_steps=4, start_layer=1)
        ref = base.attribute(x, TARGETS, output="tokens")
        for ibs in (1, 5, 100):
            close(base.attribute(x, TARGETS, output="tokens", internal_batch_size=ibs), ref,
                  1e-12)
        one = torch.cat([base.attribute(x[i:i + 1], int(TARGETS[i]), output="tokens")
                         for i in range(3)])
        close(one, ref, 1e-12)
    ad = adapt(model)
    tr = ad.trace(x, grad=True)
    (g,) = torch.autograd.grad(tr.logits.gather(1, TARGETS[:, None]).sum(),
                               [tr.blocks[-1].attn])
    full = integrated_attention_gradient(ad, x, TARGETS, n_steps=6, internal_batch_size=4)
    reuse = integrated_attention_gradient(ad, x, TARGETS, n_steps=6, grad_at_input=g)
    close(reuse, full, 1e-12)
    close(reasoning_feedback(ad, x, TARGETS, n_steps=6), full.clamp(min=0).mean(1), 1e-12)
    # defaults: BT starts at block 3, TAM at 4, both clamped to the last block L - 1
    assert BTH(model).n_steps == TAM(model).n_steps == 20
    shallow = make_model("vit", depth=3)
    for cls, mod, clamped in ((BTH, model, 3), (BTT, model, 3), (BTH, shallow, 2),
                              (TAM, model, 3), (TAM, shallow, 2)):
        close(cls(mod, n_steps=3).attribute(x, TARGETS, output="tokens"),
              cls(mod, n_steps=3, start_layer=clamped).attribute(x, TARGETS, output="tokens"),
              0)


@pytest.mark.parametrize("family", ["vit", "map"])
@pytest.mark.parametrize("base", ["bt_h", "bt_t", "tam"])
def test_plus_fast_path_equals_the_method_on_every_subnetwork(family, base):
    """PLUS / SkipPLUS: the suffix-product hook equals the method built on every
    sub-network (fast=False), float64, also where l + start_layer passes the last block."""
    model, x = model_of(family), make_inputs(family)
    k = adapt(model).num_prefix
    for kw, layers in (({"n_steps": 3}, None), ({"n_steps": 3, "start_layer": 1}, [0, 1, 2])):
        fast = PLUS(model, base, layers=layers)
        slow = PLUS(model, base, layers=layers, fast=False)
        assert (fast.route, slow.route) == ("hook", "method")
        close(fast.layer_maps(x, TARGETS, base_kwargs=kw)[..., k:],
              slow.layer_maps(x, TARGETS, base_kwargs=kw)[..., k:])
    with pytest.raises(ValueError, match="start_layer"):  # not in the 1-block f_{L-1}
        PLUS(model, base).attribute(x, TARGETS, n_steps=3, start_layer=1)
    sp = SkipPLUS(model, base).attribute(x, TARGETS, output="tokens", n_steps=3)
    slow = SkipPLUS(model, base, fast=False).attribute(x, TARGETS, output="tokens", n_steps=3)
    close(sp, slow)
    method = {"bt_h": BTH, "bt_t": BTT, "tam": TAM}[base](model, start_layer=0, n_steps=3)
    close(PLUS(model, base, layers=[0]).attribute(x, TARGETS, output="tokens", n_steps=3,
                                                  start_layer=0),
          method.attribute(x, TARGETS, output="tokens"))


def test_bad_options_name_the_argument():
    model = model_of("vit")
    with pytest.raises(ValueError, match="n_steps"):
        BTH(model, n_steps=1)
    with pytest.raises(TypeError, match="n_steps"):
        TAM(model, n_steps=2.5)
    with pytest.raises(ValueError, match="start_layer"):
        BTT(model, start_layer=-1)
    with pytest.raises(ValueError, match="start_layer"):
        TAM(model, start_layer=DEPTH)
    with pytest.raises(ValueError, match="internal_batch_size"):
        TAM(model, internal_batch_size=0)
    with pytest.raises(TypeError, match="integrated"):
        TAM(model, integrated="yes")
    x = make_inputs("vit", 1)
    with pytest.raises(ValueError, match="n_steps"):
        BTH(model).attribute(x, n_steps=0)
    with pytest.raises(ValueError, match="score"):
        TAM(model).attribute(x, score="prob")
    with pytest.raises(ValueError, match="aggregate"):
        PLUS(model, "bt_h", aggregate="layer")


def test_value_outputs_with_an_inner_attention_norm():
    """BlockParts.value_outputs: v W_O (value bias in, output bias out); with EVA-02's inner
    norm the linearised N_in (own mean, σ of the real attention output, γ, no β), which for
    an attention that keeps every token to itself (A = I) is the real N_in without β."""
    model, x = make_model("eva02"), make_inputs("eva02", 2)
    ad = adapt(model)
    tr = ad.trace(x)
    p, rec = ad.blocks[1], tr.blocks[1]
    v = torch.nn.functional.linear(rec.u, p.v_weight, p.v_bias)
    n = v.shape[1]
    eye = torch.eye(n, dtype=x.dtype).expand(2, p.num_heads, n, n)
    want = torch.nn.functional.layer_norm(v, v.shape[-1:], p.inner_norm.weight, None,
                                          p.inner_norm.eps) @ p.proj_weight.T
    close(p.value_outputs(rec.u, eye), want, 1e-12)
    with pytest.raises(ValueError, match="attn"):
        p.value_outputs(rec.u)
    plain = adapt(model_of("vit"))
    q, r = plain.blocks[0], plain.trace(make_inputs("vit")).blocks[0]
    close(q.value_outputs(r.u),
          torch.nn.functional.linear(r.u, q.v_weight, q.v_bias) @ q.proj_weight.T, 1e-12)
