"""Train a bundled model of ``captum_vit.zoo`` on FashionMNIST-Loc (CPU, deterministic).

Example (``scripts/train_bundled.sh`` trains both shipped models; the exact command of
each is also in its model card)::

    python scripts/train_zoo.py --name vit_fmnist_loc --embed-dim 96 --depth 4 --heads 4 \
        --mlp-ratio 2 --epochs 32 --lr 2e-3 --seed 1 --threads 2

Writes ``captum_vit/zoo/<name>.safetensors`` (float32 state dict, no pickle) and
``captum_vit/zoo/<name>.json`` (model card: timm kwargs, normalisation, accuracies,
learning curve, command, seed, duration).

Under ``torchrun --standalone --nproc_per_node=N`` each process takes 1/N of every batch
(contiguous rows) and the gradients are averaged over the processes before clipping
(gloo), so every process takes the same optimiser steps as one process on the whole batch,
up to floating-point summation order; evaluation is sharded the same way and rank 0 writes
the files. On a 2-core CPU two one-thread processes train a narrow model about twice as
fast as one process with two threads (its matrices are too small to split)::

    torchrun --standalone --nproc_per_node=2 scripts/train_zoo.py --name vit_fmnist_loc_deep \
        --embed-dim 64 --depth 12 --heads 4 --mlp-ratio 2 --epochs 11 --lr 2e-3 --seed 1 \
        --threads 1 --distill-from captum_vit/zoo/vit_fmnist_loc.safetensors
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from captum_vit.data import center_on_canvas, load_fashion_mnist, make_batch  # noqa: E402
from captum_vit.data.loc import build_arrays  # noqa: E402

MEAN, STD = 0.1, 0.25  # FashionMNIST-Loc pixel statistics, rounded


def build_model(kwargs: dict) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(**kwargs)


def init_from(model: torch.nn.Module, path: str) -> list[str]:
    """Start ``model`` from the trained weights in ``path`` (safetensors).

    Tensors of equal shape are copied. When ``model`` has more register tokens than the
    source, each new register token starts as a copy of the trained class token and its
    position-embedding row as a copy of the class token's row (timm's prefix order is
    class token, register tokens, patches), so training resumes from a working model.
    Returns the names of the tensors that were not copied verbatim.
    """
    from safetensors.torch import load_file

    src = load_file(path)
    dst = model.state_dict()
    changed = []
    n_old = src["pos_embed"].shape[1] - dst["pos_embed"].shape[1] + model.num_prefix_tokens
    with torch.no_grad():
        for name, t in dst.items():
            if name in src and src[name].shape == t.shape:
                t.copy_(src[name])
            elif (name == "pos_embed" and 1 <= n_old < model.num_prefix_tokens
                  and src[name].shape[2] == t.shape[2]):
                new = model.num_prefix_tokens - n_old
                cls_row = src[name][:, :1]
                t.copy_(torch.cat([src[name][:, :n_old], cls_row.expand(-1, new, -1),
                                   src[name][:, n_old:]], 1))
                changed.append(name)
            elif (name == "reg_token" and "cls_token" in src
                  and src["cls_token"].shape[2] == t.shape[2]):
                t.copy_(src["cls_token"].expand_as(t))
                changed.append(name)
            else:
                raise ValueError(f"--init-from {path}: cannot map tensor {name!r} "
                                 f"{tuple(t.shape)} from the source model.")
    return changed


def load_teacher(path: str) -> torch.nn.Module:
    """The trained model in ``path`` (safetensors, with its model card ``.json`` beside it),
    in eval mode with frozen weights: the teacher of a distillation."""
    from safetensors.torch import load_file

    card = json.loads(Path(path).with_suffix(".json").read_text())
    teacher = build_model(card["timm_kwargs"])
    teacher.load_state_dict(load_file(path))
    teacher.eval().requires_grad_(False)
    return teacher


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      labels: torch.Tensor, alpha: float, temperature: float) -> torch.Tensor:
    """``(1 - alpha) * CE(student, labels; smoothing 0.1) + alpha * T^2 * KL(teacher_T ||
    student_T)`` with both softmaxes at temperature ``T`` (Hinton et al. 2015); ``alpha = 0``
    is the plain loss."""
    hard = F.cross_entropy(student_logits, labels, label_smoothing=0.1)
    if alpha == 0:
        return hard
    t = temperature
    soft = F.kl_div(F.log_softmax(student_logits / t, -1), F.log_softmax(teacher_logits / t, -1),
                    reduction="batchmean", log_target=True) * t * t
    return (1 - alpha) * hard + alpha * soft


def _world() -> tuple[int, int]:
    """(rank, world size): (0, 1) unless a process group is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard(n: int) -> slice:
    """This process's contiguous share of ``n`` rows."""
    rank, world = _world()
    per = -(-n // world)
    return slice(rank * per, min(n, (rank + 1) * per))


def _sum_over_processes(t: torch.Tensor) -> torch.Tensor:
    if _world()[1] > 1:
        dist.all_reduce(t)
    return t


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int = 500) -> float:
    """Top-1 accuracy on ``x`` (uint8 images), sharded over the processes."""
    model.eval()
    n = len(x)
    part = _shard(n)
    x, y = x[part], y[part]
    correct = torch.zeros((), dtype=torch.float64)
    dev = next(model.parameters()).device
    for i in range(0, len(x), bs):
        xb = (x[i:i + bs].to(dev).float() / 255 - MEAN) / STD
        correct += (model(xb[:, None]).argmax(-1).cpu() == y[i:i + bs]).sum().item()
    return _sum_over_processes(correct).item() / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--patch-size", type=int, default=7,
                    help="patch side in pixels; must divide the 56-pixel canvas")
    ap.add_argument("--embed-dim", type=int, default=64)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--mlp-ratio", type=float, default=2.0)
    ap.add_argument("--reg-tokens", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu",
                    help="torch device; the shipped weights are trained on CPU, where runs "
                         "are bit-for-bit reproducible")
    ap.add_argument("--train-n", type=int, default=60000, help="training examples per epoch")
    ap.add_argument("--init-from", default=None,
                    help="safetensors of a trained model to start from (e.g. to add register "
                         "tokens to a trained model and fine-tune it)")
    ap.add_argument("--distill-from", default=None,
                    help="safetensors of a trained model (card beside it) whose logits the "
                         "student also matches (knowledge distillation)")
    ap.add_argument("--distill-alpha", type=float, default=0.5,
                    help="weight of the distillation term (with --distill-from)")
    ap.add_argument("--distill-temperature", type=float, default=2.0)
    ap.add_argument("--out-dir", default=str(ROOT / "captum_vit" / "zoo"))
    args = ap.parse_args()

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun
        dist.init_process_group("gloo")
    rank, world = _world()
    if args.batch_size % world:
        ap.error(f"--batch-size {args.batch_size} is not divisible by {world} processes")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    if 56 % args.patch_size:
        ap.error(f"--patch-size {args.patch_size} does not divide the 56-pixel canvas")
    kwargs = dict(img_size=56, patch_size=args.patch_size, in_chans=1, num_classes=10,
                  embed_dim=args.embed_dim, depth=args.depth, num_heads=args.heads,
                  mlp_ratio=args.mlp_ratio, reg_tokens=args.reg_tokens, qkv_bias=True)
    model = build_model(kwargs)
    init_note = None
    if args.init_from:
        changed = init_from(model, args.init_from)
        src_card = Path(args.init_from).with_suffix(".json")
        init_note = {"path": Path(args.init_from).name, "adapted_tensors": changed}
        if src_card.exists():
            src_meta = json.loads(src_card.read_text())
            init_note.update(command=src_meta.get("command"),
                             duration_minutes=src_meta.get("duration_minutes"))
    teacher = load_teacher(args.distill_from) if args.distill_from else None
    alpha = args.distill_alpha if teacher is not None else 0.0
    distill_note = None if teacher is None else {
        "path": Path(args.distill_from).name, "alpha": alpha,
        "temperature": args.distill_temperature}
    tr_img, tr_lab = load_fashion_mnist("train")
    te_img, te_lab = load_fashion_mnist("test")
    test = build_arrays(te_img, te_lab, split="test", seed=0)  # FashionMNIST-Loc test split
    plain = center_on_canvas(te_img, 56)
    val_x, val_y = test["images"][:2000], test["labels"][:2000]

    model.to(args.device)
    if teacher is not None:
        teacher.to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = args.train_n // args.batch_size
    total = steps_per_epoch * args.epochs

    def lr_at(step: int) -> float:
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        p = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
        return args.lr * 0.5 * (1 + math.cos(math.pi * p))

    curve = []
    step = 0
    gen = torch.Generator().manual_seed(args.seed)
    for epoch in range(args.epochs):
        order = torch.randperm(len(tr_img), generator=gen)[:args.train_n]
        xs, ys = make_batch(tr_img, tr_lab, order.tolist(), split="train", seed=args.seed,
                            epoch=epoch)
        xs, ys = ((xs - MEAN) / STD).to(args.device), ys.to(args.device)
        model.train()
        run_loss = 0.0
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{args.epochs}",
                   file=sys.stderr, mininterval=10, disable=rank > 0)
        params = [p for p in model.parameters() if p.requires_grad]
        for i in bar:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            xb = xs[i * args.batch_size:(i + 1) * args.batch_size]
            yb = ys[i * args.batch_size:(i + 1) * args.batch_size]
            part = _shard(len(xb))
            xb, yb = xb[part], yb[part]
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(xb)
            loss = distillation_loss(model(xb), t_logits if teacher is not None else None, yb,
                                     alpha, args.distill_temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:  # the mean over the whole batch: average the equal shards
                flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach()[None]])
                flat = _sum_over_processes(flat) / world
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
                loss = flat[-1]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            run_loss = 0.98 * run_loss + 0.02 * loss.item() if i else loss.item()
            bar.set_postfix(loss=f"{run_loss:.3f}", refresh=False)
        val = accuracy(model, val_x, val_y)
        curve.append({"epoch": epoch + 1, "train_loss": round(run_loss, 4),
                      "val_acc_first2000_test": round(val, 4),
                      "minutes": round((time.time() - t_start) / 60, 1)})
        if rank == 0:
            print(json.dumps(curve[-1]), flush=True)

    model.eval()
    acc_loc = accuracy(model, test["images"], test["labels"])
    acc_plain = accuracy(model, plain, te_lab)
    minutes = (time.time() - t_start) / 60
    if rank > 0:
        dist.destroy_process_group()
        return
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / f"{args.name}.safetensors"))
    card = {
        "name": args.name,
        "architecture": "timm.models.vision_transformer.VisionTransformer",
        "timm_kwargs": kwargs,
        "normalization": {"mean": [MEAN], "std": [STD]},
        "input": "grayscale 56x56 in [0, 1], then (x - mean) / std",
        "dataset": "FashionMNIST-Loc (captum_vit.data), seed 0 test split; train split "
                   "re-placed every epoch (epoch in the random key)",
        "accuracy": {"fashionmnist_loc_test_10000": round(acc_loc, 4),
                     "fashion_mnist_test_plain_centered_10000": round(acc_plain, 4)},
        "learning_curve": curve,
        "command": (f"torchrun --standalone --nproc_per_node={world} " if world > 1
                    else "python ") + "scripts/train_zoo.py " + " ".join(sys.argv[1:]),
        "seed": args.seed,
        "init_from": init_note,
        "distilled_from": distill_note,
        "duration_minutes": round(minutes, 1),
        "threads": args.threads,
        "processes": world,
        "device": args.device,
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / f"{args.name}.json").write_text(json.dumps(card, indent=1) + "\n")
    print(json.dumps(card["accuracy"]), f"{minutes:.1f} min", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
