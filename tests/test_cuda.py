"""GPU paths (skipped without CUDA): device recorded, map_location, in-place restore on the GPU."""

import pytest
import torch

import forkpoint as fp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_tensors_round_trip_and_map_location(repo):
    t = torch.randn(1000, 100, device="cuda")
    repo.save({"t": t, "bf": t.to(torch.bfloat16)})
    assert repo.manifest().leaves[0].device == "cuda:0"
    assert repo.load()["t"].device.type == "cpu"
    on_gpu = repo.load(map_location="cuda")
    assert on_gpu["t"].device.type == "cuda" and torch.equal(on_gpu["t"], t)


def test_restore_into_cuda_model_in_place(repo):
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    repo.save({"model": model, "optim": opt, "rng": fp.RNGState()})
    m2 = torch.nn.Linear(64, 64).cuda()
    o2 = torch.optim.AdamW(m2.parameters())
    ptr = m2.weight.data_ptr()
    repo.restore({"model": m2, "optim": o2, "rng": fp.RNGState()}, "main")
    assert m2.weight.data_ptr() == ptr and torch.equal(m2.weight, model.weight)
    assert o2.state_dict()["state"][0]["exp_avg"].device.type == "cuda"
