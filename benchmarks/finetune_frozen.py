"""Fine-tuning with a frozen backbone: bytes stored per version against the trainable part.

A backbone of 9 × Linear(1024, 1024) is frozen (90% of the parameters); a head of
1 × Linear(1024, 1024) trains with AdamW. Each of `--versions` versions is saved after a
few steps. Unchanged tensors (the backbone) are deduplicated by content, so a version
should store only the head and its optimizer state.

    python benchmarks/finetune_frozen.py --versions 5 --dir /work
"""

import os
import shutil
import sys

import torch

import forkpoint as fp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def main():
    ap = harness.arguments(__doc__, repeats=None)
    ap.add_argument("--versions", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(9)])
    head = torch.nn.Linear(1024, 1024)
    for p in backbone.parameters():
        p.requires_grad_(False)
    model = torch.nn.Sequential(backbone, head)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    trainable = sum(p.numel() * 4 for p in head.parameters())
    total = sum(p.numel() * 4 for p in model.parameters())
    path = harness.scratch(args.dir, prefix="fp-frozen-")
    repo = fp.Repo(path, create=True)
    print(f"parameters {total / 2**20:.1f} MiB, trainable {trainable / 2**20:.1f} MiB "
          f"({100 * trainable / total:.0f}%), + AdamW moments of the trainable part {2 * trainable / 2**20:.1f} MiB\n")
    print("| version | logical | newly stored | stored / (trainable + its moments) |")
    print("|---|---|---|---|")
    for v in range(args.versions):
        for _ in range(3):
            model(torch.randn(16, 1024)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        version = repo.save({"model": model, "optim": opt}, step=v)
        print(f"| {v} | {version.logical_bytes / 2**20:.1f} MiB | {version.stored_bytes / 2**20:.2f} MiB | "
              f"{version.stored_bytes / (3 * trainable):.3f} |")
    repo.close()
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
