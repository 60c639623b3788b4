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


def _fences(pending):
    return [t for ts in pending.capture_map.values() for t in ts if hasattr(t, "order")]


def test_async_capture_copies_on_a_side_stream_and_orders_the_optimizer_after_it(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    model = torch.nn.Linear(2048, 2048).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ck = fp.Checkpointer(repo, {"model": model, "optim": opt}, every=1000)
    assert repo.device.pool.held >= 2048 * 2048 * 4
    model.weight.grad = torch.zeros_like(model.weight)
    model.bias.grad = torch.zeros_like(model.bias)
    opt.step()  # loads the step's kernels now: a lazy module load would synchronize the device
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.weight.grad.fill_(1)
    model.bias.grad.fill_(1)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    pending = ck.save(1)
    fences = _fences(pending)
    opt.step()
    assert fences and all(not f.done() for f in fences), "the host waited for the device"
    assert all(f.host.is_pinned() for f in fences)
    ck.close()
    saved = repo.load()["model"]
    for k, t in before.items():
        assert torch.equal(saved[k], t.cpu()), k
    assert torch.equal(model.weight, before["weight"] - 0.5)
    repo.close()


def test_pinned_buffers_are_reused_across_saves(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    state = {"a": torch.randn(1 << 20, device="cuda"), "b": torch.randn(300, 700, device="cuda")}
    repo.save(state, sync=False).wait()
    held = repo.device.pool.held
    for i in range(3):
        state["a"].add_(1)
        repo.save(state, sync=False).wait()
    assert repo.device.pool.held == held
    assert torch.equal(repo.load()["a"], state["a"].cpu())
    repo.close()


def test_device_capture_beyond_pinned_budget_copies_synchronously(tmp_path):
    from forkpoint.engine.save import SaveOptions

    repo = fp.Repo(str(tmp_path / "r"), create=True,
                   options=SaveOptions(staging_bytes=1 << 20, chunk_bytes=1 << 20))
    big = torch.randn(4 << 20, device="cuda")
    small = torch.randn(1000, device="cuda")
    pending = repo.save({"big": big, "small": small}, sync=False)
    assert len(_fences(pending)) == 1
    pending.wait_capture()
    expected = big.clone()
    big.zero_()
    small.zero_()
    pending.wait()
    out = repo.load()
    assert torch.equal(out["big"], expected.cpu()) and out["small"].abs().sum() > 0
    assert repo.device.pool.held <= 1 << 20
    repo.close()


def test_device_leaves_of_every_layout_round_trip_async(repo):
    base = torch.randn(512, 384, device="cuda")
    state = {"t": base.t(), "bf": base.to(torch.bfloat16), "i": torch.arange(10, device="cuda"),
             "b": base > 0, "c": torch.randn(64, dtype=torch.complex64, device="cuda"),
             "scalar": torch.tensor(3.5, device="cuda"), "empty": torch.empty(0, device="cuda")}
    expected = {k: v.cpu().clone() for k, v in state.items()}
    pending = repo.save(state, sync=False)
    pending.wait_capture()
    for v in state.values():
        if v.numel() and v.dtype != torch.bool:
            v.zero_()
    pending.wait()
    out = repo.load()
    for k, v in expected.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    assert repo.manifest().leaves[0].device == "cuda:0"


def test_deferred_device_copy_fills_only_the_ranges_launched(tmp_path):
    from forkpoint.state.device import DeviceCapture

    capture = DeviceCapture(64 << 20)
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    copy = capture.copy(src, deferred=True)
    assert not copy.launched
    copy.host.fill_(0)
    copy.launch([(0, 4096), (1 << 20, (1 << 20) + 8192)])
    copy.wait()
    expected = src.cpu().view(torch.uint8)
    assert torch.equal(copy.host[:4096], expected[:4096])
    assert torch.equal(copy.host[1 << 20:(1 << 20) + 8192], expected[1 << 20:(1 << 20) + 8192])
    assert not copy.host[4096:1 << 20].any(), "bytes outside the ranges are not copied"
    copy.release()
    unused = capture.copy(src, deferred=True)
    unused.release()
    nbytes = src.numel() * 4
    assert capture.pool.held == nbytes and len(capture.pool.free[nbytes]) == 1, \
        "a copy never launched gives its buffer back, and buffers are reused"


def test_distributed_save_of_replicated_cuda_tensors(tmp_path):
    """Two ranks on one GPU save replicated CUDA tensors; each copies and writes its part, the
    versions load back exactly (the asynchronous one as it was when captured)."""
    from test_dist import launch

    records = launch("cuda_replicated_saves", 2, tmp_path / "out", str(tmp_path / "r"))
    reference = torch.load(tmp_path / "out" / "reference.pt")
    repo = fp.Repo(str(tmp_path / "r"))
    first, second = (repo.load(v) for v in records[0]["result"]["versions"])
    assert torch.equal(second["w"], reference["w"]) and torch.equal(first["w"], reference["w"] / 2)
    assert torch.equal(first["b"], reference["b"])
    assert all(0 < r["result"]["written"] < 1.5 * 2 * 512 * 1024 * 4 for r in records), "each rank wrote a part"


def test_checkpoint_graph_offloads_stored_inputs_to_host_memory():
    """On a GPU, inputs the multilevel schedule puts on level 1 live in host memory and come
    back for the backward sweep; gradients equal plain backprop (no dropout: the executor
    replays the CPU random stream only)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
                                  for _ in range(12)]).cuda()
    x = torch.randn(64, 256, device="cuda")
    model(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    wrapped = fp.adjoint.checkpoint_graph(model, x, memory_budget=2 * x.nbytes, offload="cpu")
    wrapped(x).square().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    assert wrapped.stats.peak_bytes <= 2 * x.nbytes and wrapped.stats.peak.get(1, 0) > 0
