#!/usr/bin/env python
"""Train Zoology's own model on its figure 2 MQAR cell, as an outside reference for ours.

    python benchmarks/mqar_zoology_reference.py --zoology PATH --lr 2.15e-3 --out runs/zoo_ref.jsonl

This script imports, unmodified, the model (``zoology.model.LanguageModel`` with
``zoology.mixers.attention.MHA``) and the generator (``zoology.data.associative_recall.multiquery_ar``)
of a checkout of HazyResearch/zoology at the paper's version (commit c3fae54, 2023-12-11; later
versions build the embeddings on CUDA), and trains them the way its ``zoology/train.py`` does
(seeds: data ``DataConfig.seed`` 0, model ``TrainConfig.seed`` 123; AdamW over all parameters,
weight decay 0.1; cosine to 0 over the epochs, stepped once per epoch; batches reshuffled each
epoch; stop when test accuracy > 0.99), with the settings of its figure 2 configs by default:
100,000 examples of (L, N) = (256, 16) with zeros between the queries, 3,000 test examples,
batch 256, d_model 64, one head, attention dropout 0.1, embedding dropout 0.1, 64 epochs. One
departure, exact in value: the vocabulary head is applied at the query positions only (Zoology
applies it at every position and ignores the rest in the loss), which makes a CPU update many
times cheaper and changes neither the loss nor the gradient.

It needs PyTorch (with torchvision, einops, pydantic, tqdm and wandb, which Zoology imports) and
the checkout, neither of which this project depends on; a missing one is a one-line error. Each
evaluation prints and appends a JSON line to ``--out``: update, epoch, lr, mean train loss since
the last evaluation, test loss, test accuracy, seconds of training; ``RUN.meta.json`` beside it
records the commits, versions and settings when training starts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--zoology", help="a checkout of HazyResearch/zoology at commit c3fae54")
    p.add_argument("--out", required=True, help="JSONL file of evaluations (appended)")
    p.add_argument(
        "--lr",
        type=float,
        default=10 ** (-4 + 2 * 2 / 3),
        help="figure 2 sweeps np.logspace(-4, -2, 4); default its third value, 2.15e-3",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--kv", type=int, default=16)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=64)
    p.add_argument("--train-examples", type=int, default=100_000)
    p.add_argument("--test-examples", type=int, default=3_000)
    p.add_argument(
        "--random-non-queries", action="store_true", help="Zoology's default; figure 2 sets False"
    )
    p.add_argument("--data-seed", type=int, default=0, help="DataConfig.seed (Zoology's default 0)")
    p.add_argument("--seed", type=int, default=123, help="TrainConfig.seed (Zoology's default 123)")
    p.add_argument("--eval-every", type=int, default=100, help="updates between evaluations")
    p.add_argument("--max-updates", type=int, default=None)
    p.add_argument("--max-hours", type=float, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument(
        "--table",
        metavar="MD",
        help="render the page MD from --out and its .meta.json (a new page: --title); no training",
    )
    p.add_argument(
        "--title", default="Zoology's model on its figure 2 MQAR cell", help="a new page's heading"
    )
    return p.parse_args(argv)


def query_loss(backbone, head, inputs, labels):
    """Zoology's loss and accuracy with the head applied at the labelled positions only.

    ``inputs``, ``labels``: [B, T] token ids, labels -100 where ignored. Returns (mean cross-entropy
    over the labelled positions, their accuracy), equal in value and gradient to Zoology's
    ``CrossEntropyLoss()(head(backbone(inputs)) [B*T, V], labels [B*T])``, which ignores -100.
    """
    import torch.nn.functional as F

    hidden = backbone(inputs)  # [B, T, d]
    mask = labels != -100
    logits = head(hidden[mask])  # [B * N, V]
    target = labels[mask]
    return F.cross_entropy(logits, target), (logits.argmax(-1) == target).float().mean()


REPO = Path(__file__).resolve().parents[1]


def meta_path(out: str | Path) -> Path:
    """``run.jsonl`` -> ``run.meta.json``: where the evaluations came from."""
    return Path(out).with_suffix(".meta.json")


def write_meta(args: argparse.Namespace, root: Path, torch_version: str) -> None:
    """The JSONL's provenance, written before training: this project's commit, Zoology's,
    the versions and every setting (this runs in a venv apart from this project's, so it asks
    git itself rather than ``linear_gpt2.platform.provenance``)."""

    def git(where: Path, *cmd: str) -> str | None:
        r = subprocess.run(["git", "-C", str(where), *cmd], capture_output=True, text=True)
        return r.stdout.strip() or None if r.returncode == 0 else None

    dirty = git(REPO, "status", "--porcelain", "--untracked-files=no")
    commit = git(REPO, "rev-parse", "HEAD")
    meta = {
        "how": "measured",
        "raw": Path(args.out).name,
        "environment": {
            "device_kind": f"cpu ({args.threads} torch thread(s))", "platform": "cpu",
            "jax_version": None, "torch_version": torch_version,
            "zoology_commit": git(root, "rev-parse", "--short", "HEAD"),
            "git_commit": commit and commit + ("+dirty" if dirty else ""), "host": platform.node(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "command": "python benchmarks/mqar_zoology_reference.py " + " ".join(sys.argv[1:]),
        "settings": {
            "L": args.seq_len, "N": args.kv, "d_model": args.d_model, "layers": 2, "heads": 1,
            "train_examples": args.train_examples, "test_examples": args.test_examples,
            "batch": args.batch, "lr": args.lr, "weight_decay": 0.1, "epochs": args.epochs,
            "budget_sequences": args.epochs * args.train_examples, "eval_every": args.eval_every,
            "max_hours": args.max_hours, "random_non_queries": args.random_non_queries,
        },
    }  # fmt: skip
    meta_path(args.out).write_text(json.dumps({"meta": meta}, indent=1) + "\n")


def table(args: argparse.Namespace) -> int:
    """Render ``--table MD`` from ``--out`` and its ``.meta.json`` (``linear_gpt2`` reports)."""
    sys.path.insert(0, str(REPO))
    from studies import common as reports

    md, out = Path(args.table), Path(args.out)
    if not meta_path(out).is_file():
        print(
            f"error: {meta_path(out)} is missing; it is written when training starts",
            file=sys.stderr,
        )
        return 2
    rel = lambda p: os.path.relpath(p, md.parent)  # noqa: E731
    sources = (rel(out), rel(meta_path(out)))
    template = "\n".join([
        f"# {args.title}",
        "",
        reports.block("mqar.zoology_about", *sources),
        reports.block("mqar.zoology_reference", *sources),
    ])  # fmt: skip
    reports.page(md, template)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        return table(args)
    if not args.zoology:
        print(
            "error: --zoology PATH is needed to train (or --table MD to tabulate --out)",
            file=sys.stderr,
        )
        return 2
    try:
        import numpy as np
        import torch
    except ImportError as e:
        print(
            f"error: {e.name} is missing; install PyTorch in a separate venv: pip install torch torchvision "
            "einops pydantic wandb",
            file=sys.stderr,
        )
        return 2
    root = Path(args.zoology)
    if not (root / "zoology" / "model.py").is_file():
        print(
            f"error: {root} is not a zoology checkout (no zoology/model.py); "
            "git clone https://github.com/HazyResearch/zoology and pass its path",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(root))
    try:
        from zoology.data.associative_recall import multiquery_ar
    except ImportError:
        print(
            f"error: {root} is not zoology's paper version (no zoology.data.associative_recall."
            f"multiquery_ar); git -C {root} checkout c3fae54",
            file=sys.stderr,
        )
        return 2
    from zoology.config import ModelConfig, ModuleConfig
    from zoology.model import LanguageModel
    from zoology.utils import set_determinism

    torch.set_num_threads(args.threads)
    write_meta(args, root, torch.__version__)
    t0 = time.time()
    data = multiquery_ar(
        vocab_size=8192,
        num_train_examples=args.train_examples,
        num_test_examples=args.test_examples,
        input_seq_len=args.seq_len,
        seed=args.data_seed,
        num_kv_pairs=args.kv,
        random_non_queries=args.random_non_queries,
    )
    print(
        f"data: {args.train_examples} + {args.test_examples} examples in {time.time() - t0:.1f} s",
        flush=True,
    )

    set_determinism(args.seed)  # train() seeds before building the model
    model = LanguageModel(
        ModelConfig(
            d_model=args.d_model,
            n_layers=2,
            block_type="TransformerBlock",
            max_position_embeddings=args.seq_len,
            vocab_size=8192,
            sequence_mixer=ModuleConfig(
                name="zoology.mixers.attention.MHA", kwargs={"dropout": 0.1, "num_heads": 1}
            ),
            state_mixer=ModuleConfig(name="torch.nn.Identity", kwargs={}),
        )
    )
    for m in model.modules():  # TokenEmbeddings defaults to device='cuda' for its positions
        if hasattr(m, "device") and isinstance(m.device, str):
            m.device = "cpu"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=0.0)

    def loss_acc(inputs, labels):
        return query_loss(model.backbone, model.lm_head, inputs, labels)

    def evaluate():
        model.eval()
        losses, accs = [], []
        with torch.no_grad():
            for s in range(0, len(data.test_inputs), args.batch):
                lo, ac = loss_acc(
                    data.test_inputs[s : s + args.batch], data.test_labels[s : s + args.batch]
                )
                losses.append(lo.item())
                accs.append(ac.item())
        model.train()
        return float(np.mean(losses)), float(np.mean(accs))

    n_train = len(data.train_inputs)
    # Zoology's DataLoader(shuffle=True): a new order each epoch.
    gen = torch.Generator().manual_seed(args.seed)
    update, train_s, run_loss, run_n = 0, 0.0, 0.0, 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.train()
    for epoch in range(args.epochs):
        order = torch.randperm(n_train, generator=gen)
        for b in range(0, n_train, args.batch):
            t = time.time()
            idx = order[b : b + args.batch]
            loss, _ = loss_acc(data.train_inputs[idx], data.train_labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            train_s += time.time() - t
            update += 1
            run_loss, run_n = run_loss + loss.item(), run_n + 1
            done = (args.max_updates and update >= args.max_updates) or (
                args.max_hours and train_s > 3600 * args.max_hours
            )
            if update % args.eval_every == 0 or done:
                tl, ta = evaluate()
                row = dict(
                    update=update,
                    epoch=epoch,
                    lr=opt.param_groups[0]["lr"],
                    train_loss=run_loss / run_n,
                    test_loss=tl,
                    test_acc=ta,
                    train_s=round(train_s, 1),
                )
                run_loss, run_n = 0.0, 0
                print(json.dumps(row), flush=True)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                if ta > 0.99 or done:  # Zoology's early stop: valid/accuracy > 0.99
                    return 0
        sched.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
