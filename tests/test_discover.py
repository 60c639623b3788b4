"""fp.discover runs one training step under a dispatcher-level capture and names the state it
mutates and reads: parameters, buffers, optimizer state, random streams, schedulers; it puts
every object back as it found it."""

import pytest

torch = pytest.importorskip("torch")

import forkpoint as fp  # noqa: E402
from forkpoint.automation import DiscoveryError  # noqa: E402


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    return model, opt, sched


def step_of(model, opt, sched):
    def step(batch):
        x, y = batch
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return loss
    return step


BATCH = (torch.randn(32, 8), torch.randn(32, 1))


def snapshot(model, opt, sched):
    return ({k: v.clone() for k, v in model.state_dict().items()}, repr(opt.state_dict()), sched.state_dict(),
            torch.get_rng_state().clone())


def test_a_step_with_buffers_dropout_and_a_scheduler_is_found_whole_and_left_as_it_was():
    model, opt, sched = build()
    before = snapshot(model, opt, sched)
    found = fp.discover(model, opt, step_of(model, opt, sched), BATCH)
    after = snapshot(model, opt, sched)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]), "parameters and buffers put back"
    assert before[1:3] == after[1:3] and not opt.state, "optimizer and scheduler put back"
    assert torch.equal(before[3], after[3]), "the torch random stream put back"
    assert {"model.0.weight", "model.4.bias", "model.1.running_mean", "model.1.running_var",
            "model.1.num_batches_tracked"} <= set(found.mutated)
    assert {"optimizer.state[0.weight].exp_avg", "optimizer.state[0.weight].exp_avg_sq",
            "optimizer.state[4.bias].step"} <= set(found.mutated)
    assert found.random_streams == ["torch RNG"], "dropout draws from the torch stream"
    assert found.changed_objects == ["sched (LR scheduler)"]
    assert "model.0.weight.grad" in found.gradients and not found.unnamed
    assert list(found.state()) == ["model", "optimizer", "sched", "rng"]
    assert found.state()["sched"] is sched and found.state()["model"] is model
    assert "BatchNorm" not in str(found) and "model.1.running_mean" in str(found)


def test_a_model_in_eval_without_dropout_reads_buffers_and_draws_nothing():
    model, opt, _ = build()
    model.eval()

    def infer(x):
        with torch.no_grad():
            return model(x)

    found = fp.discover(model, None, infer, BATCH[0])
    assert not found.mutated and not found.random_streams and not found.changed_objects
    assert {"model.0.weight", "model.1.running_mean"} <= set(found.read)
    assert list(found.state()) == ["model"]


def test_tied_weights_are_one_piece_under_both_names():
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(20, 8)
            self.head = torch.nn.Linear(8, 20, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(ids):
        loss = torch.nn.functional.cross_entropy(model(ids), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()

    found = fp.discover(model, opt, step, torch.randint(0, 20, (16,)))
    assert ("model.embed.weight", "model.head.weight") in found.tied
    assert found.mutated == ["model.embed.weight"], "a tied weight is listed once"


def test_a_custom_optimizer_s_state_and_a_global_tensor_are_found():
    class Momentum(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    buf = self.state[p].setdefault("velocity", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-group["lr"])

    model = torch.nn.Linear(4, 2)
    opt = Momentum(model.parameters())
    seen = torch.zeros(())

    def step(x):
        loss = model(x).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.add_(1)

    found = fp.discover(model, opt, step, torch.randn(3, 4))
    assert {"optimizer.state[weight].velocity", "optimizer.state[bias].velocity"} <= set(found.mutated)
    assert found.changed_objects == ["seen (Tensor)"] and found.state()["seen"] is seen
    assert not found.unnamed, "a reached tensor is named by its variable"
    assert float(seen) == 0.0, "the global tensor is put back"


def test_missing_names_what_a_state_tree_leaves_out_and_the_fix():
    model, opt, sched = build()
    found = fp.discover(model, opt, step_of(model, opt, sched), BATCH)
    missing = found.missing({"model": model})
    assert [m.split(" (")[0] for m in missing] == ["optimizer", "sched", "random streams"]
    assert "add the scheduler to the state" in missing[1] and "fp.RNGState()" in missing[2]
    assert found.missing(found.state()) == []
    assert found.missing({"m": model, "o": opt, "s": sched, "r": fp.RNGState()}) == []


def test_the_checkpointer_takes_the_discovered_state_and_resumes_from_it(tmp_path):
    model, opt, sched = build()
    step = step_of(model, opt, sched)
    repo = fp.Repo(str(tmp_path / "repo"), create=True)
    ck = fp.Checkpointer(repo, fp.discover(model, opt, step, BATCH), every=1, sync=True)
    for i in range(ck.resume(), 4):
        step(BATCH)
        ck.step(i)
    ck.close()
    assert repo.log()[0].step == 3 and {"model", "optimizer", "sched", "rng"} <= set(repo.load("main"))
    model2, opt2, sched2 = build()  # as a new process would
    ck2 = fp.Checkpointer(repo, fp.discover(model2, opt2, step_of(model2, opt2, sched2), BATCH), sync=True)
    assert ck2.resume() == 4
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert sched2.last_epoch == sched.last_epoch == 4 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(opt2.state[model2[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])


def test_a_step_that_fails_or_runs_nothing_gets_a_clear_error():
    model, opt, sched = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def broken(batch):
        model(batch[0]).sum().backward()
        opt.step()
        raise ValueError("shape mismatch in my loss")

    with pytest.raises(DiscoveryError, match="shape mismatch in my loss.*step_fn\\(example_batch\\) alone"):
        fp.discover(model, opt, broken, BATCH)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "put back after a failure"
    with pytest.raises(DiscoveryError, match="ran no tensor operator"):
        fp.discover(model, opt, lambda batch: None, BATCH)
    with pytest.raises(TypeError, match="model as a torch.nn.Module, got OrderedDict"):
        fp.discover(model.state_dict(), opt, step_of(model, opt, sched), BATCH)
    with pytest.raises(TypeError, match="Optimizer or None, got StepLR"):
        fp.discover(model, sched, step_of(model, opt, sched), BATCH)
    with pytest.raises(TypeError, match="step_fn, a function of the batch"):
        fp.discover(model, opt, BATCH, step_of(model, opt, sched))


HIDDEN = [torch.zeros(3)]


def _bump_hidden():
    HIDDEN[0].add_(1)


def test_a_tensor_written_out_of_the_step_s_reach_is_reported_unnamed():
    model = torch.nn.Linear(3, 1)

    def step(x):
        model(x).sum().backward()
        _bump_hidden()  # through a function: the step names no object that holds the tensor

    found = fp.discover(model, None, step, torch.randn(2, 3))
    assert len(found.unnamed) == 1 and found.unnamed[0].startswith("a cpu tensor at 0x")
    assert "mutates unnamed (1)" in str(found)
    assert torch.equal(HIDDEN[0], torch.ones(3)), "what discover cannot name it cannot put back either"
