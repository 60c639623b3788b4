"""Interoperability: forkpoint.dcp Writer/Reader with the real torch.distributed.checkpoint
(single process), `forkpoint export --format dcp` read by stock dcp.load, and `forkpoint
import` of DCP directories, torch.save files and safetensors files."""

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import forkpoint as fp  # noqa: E402
import forkpoint.dcp  # noqa: E402
from forkpoint.cli.main import cli  # noqa: E402


class Custom:
    """A class a weights-only load refuses."""


def trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 600)).sum().backward()
    opt.step()
    return model, opt


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_non_tensor_entries_of_a_dcp_save_load_as_values(tmp_path):
    """Values DCP pickles (optimizer hyper-parameters, strings, counters) come back from
    repo.load and the exports as the values, not torch.save archives."""
    url = str(tmp_path / "repo")
    repo = fp.Repo(url, create=True)
    model, opt = trained()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "run": "baseline"},
             storage_writer=forkpoint.dcp.Writer(repo, step=3), no_dist=True)
    tree = repo.load("main")
    assert tree["epoch"] == 3 and tree["run"] == "baseline"
    assert tree["optim"]["param_groups"][0]["lr"] == 0.001 and tree["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    result = CliRunner().invoke(cli, ["export", "main", str(tmp_path / "st"), "--repo", url])
    assert result.exit_code == 0, result.output
    import json

    leaves = json.load(open(tmp_path / "st" / "state.json"))["leaves"]
    assert leaves["run"] == {"value": "baseline"} and leaves["optim/param_groups/0/lr"] == {"value": 0.001}
    target = {"model": trained(seed=1)[0].state_dict(), "optim": trained(seed=1)[1].state_dict(), "epoch": 0,
              "run": ""}
    dcp.load(target, storage_reader=forkpoint.dcp.Reader(repo, "main"), no_dist=True)
    assert target["epoch"] == 3 and target["run"] == "baseline"


def test_dcp_save_and_load_through_forkpoint(tmp_path):
    repo = fp.Repo(str(tmp_path / "repo"), create=True)
    model, opt = trained()
    writer = forkpoint.dcp.Writer(repo, branch="main", step=7, message="via dcp")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}, storage_writer=writer,
             no_dist=True)
    v = repo.version("main")
    assert writer.version.id == v.id and v.step == 7 and v.stored_bytes > 1_400_000
    tree = repo.load("main")
    assert same(tree["model"], model.state_dict()), "a DCP-written version loads natively, nested"
    other, other_opt = trained(seed=1)
    target = {"model": other.state_dict(), "optim": other_opt.state_dict(), "epoch": 0}
    dcp.load(target, storage_reader=forkpoint.dcp.Reader(repo, "main"), no_dist=True)
    assert same(target["model"], model.state_dict()) and target["epoch"] == 3
    assert torch.equal(target["optim"]["state"][1]["exp_avg_sq"], opt.state_dict()["state"][1]["exp_avg_sq"])
    again = forkpoint.dcp.Writer(repo, branch="main", step=8)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}, storage_writer=again,
             no_dist=True)
    assert again.version.stored_bytes < 10_000, "unchanged tensors are deduplicated"
    assert again.version.parents == [v.id]


def test_gc_during_a_dcp_save_spares_its_objects(tmp_path):
    """Objects a DCP save wrote are unreferenced until its finish commits them: a gc of the
    same process in between (no other writer lease, objects older than QUIET_MARGIN) spares them."""
    import os
    import time

    repo = fp.Repo(str(tmp_path / "repo"), create=True)
    model, opt = trained()
    writer = forkpoint.dcp.Writer(repo, branch="main", step=1)
    real_finish = writer.finish

    def finish_after_a_gc(metadata, results):
        then = time.time() - 60
        for key in repo.store.list("objects"):
            os.utime(os.path.join(repo.url, key), (then, then))
        assert repo.gc().deleted_objects == 0
        return real_finish(metadata, results)

    writer.finish = finish_after_a_gc
    dcp.save({"model": model.state_dict()}, storage_writer=writer, no_dist=True)
    assert repo.verify().ok and same(repo.load("main")["model"], model.state_dict())
    assert not repo.placement.writers, "the commit releases the save's pins"


def test_native_version_read_by_dcp_load(tmp_path):
    repo = fp.Repo(str(tmp_path / "repo"), create=True)
    model, opt = trained()
    version = repo.save({"model": model, "optim": opt, "step": 9, "tag": "x"}, step=9)
    other, other_opt = trained(seed=1)
    target = {"model": other.state_dict(), "optim": other_opt.state_dict(), "step": 0, "tag": ""}
    dcp.load(target, storage_reader=forkpoint.dcp.Reader(repo, version.id), no_dist=True)
    assert same(target["model"], model.state_dict()) and target["step"] == 9 and target["tag"] == "x"
    assert target["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_export_dcp_read_by_stock_dcp_and_import_back(tmp_path):
    url = str(tmp_path / "repo")
    repo = fp.Repo(url, create=True)
    model, opt = trained()
    repo.save({"model": model, "optim": opt, "step": 5}, step=5)
    out = tmp_path / "dcp-out"
    result = CliRunner().invoke(cli, ["export", "main", str(out), "--format", "dcp", "--repo", url])
    assert result.exit_code == 0, result.output
    other, other_opt = trained(seed=1)
    target = {"model": other.state_dict(), "optim": other_opt.state_dict(), "step": 0}
    dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert same(target["model"], model.state_dict()) and target["step"] == 5
    result = CliRunner().invoke(cli, ["import", str(out), "--branch", "imported", "--step", "5", "--repo", url])
    assert result.exit_code == 0, result.output
    assert "left out" not in result.output, "plain non-tensor entries load with the weights-only loader"
    tree = fp.Repo(url).load("imported")
    assert same(tree["model"], model.state_dict()) and tree["step"] == 5
    assert torch.equal(tree["optim"]["state"]["0"]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    groups = tree["optim"]["param_groups"]
    assert isinstance(groups, list) and groups[0]["lr"] == 0.001 and groups[0]["params"] == [0, 1, 2, 3], \
        "lists stay lists, as dcp_to_torch_save keeps them"
    fresh = torch.optim.Adam(trained(seed=2)[0].parameters())
    fresh.load_state_dict({"state": {}, "param_groups": groups})
    assert fresh.param_groups[0]["lr"] == 0.001
    result = CliRunner().invoke(cli, ["import", str(out), "--branch", "imported2", "--allow-pickle", "--repo", url])
    assert result.exit_code == 0, result.output
    assert fp.Repo(url).load("imported2")["step"] == 5


def test_import_torch_save_and_safetensors(tmp_path):
    from safetensors.torch import save_file

    url = str(tmp_path / "repo")
    fp.Repo(url, create=True)
    model, _ = trained()
    torch.save({"model": model.state_dict(), "epoch": 4}, tmp_path / "ckpt.pt")
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "ckpt.pt"), "--repo", url])
    assert result.exit_code == 0, result.output
    tree = fp.Repo(url).load("main")
    assert same(tree["model"], model.state_dict()) and tree["epoch"] == 4
    (tmp_path / "st").mkdir()
    sd = model.state_dict()
    save_file({k: v for k, v in sd.items() if k.startswith("0.")}, tmp_path / "st" / "model-00001.safetensors")
    save_file({k: v for k, v in sd.items() if k.startswith("1.")}, tmp_path / "st" / "model-00002.safetensors")
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "st"), "--branch", "hf", "--repo", url])
    assert result.exit_code == 0, result.output
    assert same(fp.Repo(url).load("hf"), sd)

    torch.save({"obj": Custom()}, tmp_path / "unsafe.pt")
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "unsafe.pt"), "--repo", url])
    assert result.exit_code != 0 and "--allow-pickle" in result.output
    assert "Custom" in result.output, "the error names the class it met"


def test_bad_input_to_the_adapters(tmp_path):
    url = str(tmp_path / "repo")
    repo = fp.Repo(url, create=True)
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "missing.pt"), "--repo", url])
    assert result.exit_code != 0 and "no such file" in result.output
    (tmp_path / "junk").mkdir()
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "junk"), "--repo", url])
    assert result.exit_code != 0 and "neither a DCP checkpoint" in result.output
    import traceback

    with pytest.raises(BaseException) as info:  # DCP's CheckpointException derives from BaseException
        dcp.load({"x": torch.zeros(2)}, storage_reader=forkpoint.dcp.Reader(repo, "nope"), no_dist=True)
    text = "".join(traceback.format_exception(info.value))
    assert "no branch, tag or version 'nope'" in text, "DCP wraps it, but the report names the missing ref"
    with pytest.raises(RuntimeError, match="init_process_group"):
        fp.dist.Repo(url)
    sampler = fp.dist.DistributedResumableSampler(10, rank=0, world=1)
    with pytest.raises(ValueError, match="saved over 12 items"):
        sampler.load_state_dict({"epoch": 0, "consumed": 0, "seed": 0, "length": 12, "shuffle": True})
