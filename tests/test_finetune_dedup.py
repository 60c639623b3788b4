"""Fine-tuning with a frozen backbone stores, per version, about the trainable part only."""

import pytest

import forkpoint as fp

torch = pytest.importorskip("torch")


def test_frozen_backbone_is_stored_once(tmp_path):
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(9)]).requires_grad_(False)
    head = torch.nn.Linear(512, 512)
    model = torch.nn.Sequential(backbone, head)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    trainable = 3 * sum(p.numel() * 4 for p in head.parameters())
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    stored = []
    for step in range(3):
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        opt.zero_grad()
        stored.append(repo.save({"model": model, "optim": opt}, step=step).stored_bytes)
    assert stored[0] > 3 * trainable
    assert all(s < 1.05 * trainable for s in stored[1:]), (stored, trainable)
