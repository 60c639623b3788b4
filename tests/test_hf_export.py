"""`forkpoint export --format hf`: a version written by the Transformers plug-in becomes a
Hugging Face model directory (sharded safetensors with an index, config.json) that
`from_pretrained` loads with bit-identical logits, and that `forkpoint import` reads back."""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import forkpoint as fp  # noqa: E402
from forkpoint.cli.hf_export import parse_size, shard, Weight  # noqa: E402
from forkpoint.cli.main import cli  # noqa: E402
import procs

RUN = os.path.join(os.path.dirname(__file__), "frameworks", "hf_run.py")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT-2 trained 4 steps by the Trainer, checkpointed by the plug-in."""
    tmp = tmp_path_factory.mktemp("hf")
    url = str(tmp / "repo")
    out = procs.run([sys.executable, RUN, "--repo", url, "--dir", str(tmp / "out"), "--steps", "4",
                     "--save-steps", "4", "--out", str(tmp / "final.pt")],
                    timeout=procs.CHILD_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    return url


def export(url, directory, *args):
    result = CliRunner().invoke(cli, ["export", "main", str(directory), "--format", "hf", "--repo", url, *args])
    assert result.exit_code == 0, result.output
    return result.output.split()


def test_a_sharded_export_loads_with_from_pretrained_and_gives_identical_logits(trained, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    files = export(trained, tmp_path / "hf", "--max-shard-size", "40KB")
    names = sorted(os.listdir(tmp_path / "hf"))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", names
    assert {"model.safetensors.index.json", "config.json"} <= set(names) and len(files) == len(names)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    stored = fp.Repo(trained).load("main")["model"]
    assert set(index["weight_map"]) == set(stored) - {"lm_head.weight"}, "the tied head is left to the config"
    assert all(os.path.getsize(tmp_path / "hf" / s) < 40_000 + 16_384 or
               len(load_file(tmp_path / "hf" / s)) == 1 for s in shards), "shards respect the size"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for k, t in stored.items()
                                                  if k != "lm_head.weight")

    exported = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    reference = GPT2LMHeadModel(GPT2Config(**json.loads((tmp_path / "hf" / "config.json").read_text()))).eval()
    reference.load_state_dict(stored)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits), "bit-identical logits"
    assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()


def test_one_shard_is_model_safetensors_and_import_reads_the_layout_back(trained, tmp_path):
    export(trained, tmp_path / "hf")
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    sharded = tmp_path / "sharded"
    export(trained, sharded, "--max-shard-size", "40KB")
    stored = fp.Repo(trained).load("main")["model"]
    for source in (tmp_path / "hf", sharded):
        url = str(source) + "-repo"
        fp.Repo(url, create=True).close()
        result = CliRunner().invoke(cli, ["import", str(source), "--repo", url])
        assert result.exit_code == 0, result.output
        back = fp.Repo(url).load("main")
        assert set(back) == set(stored) - {"lm_head.weight"}
        assert all(torch.equal(back[k], stored[k]) for k in back)


def test_prefix_and_config_options(trained, tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text('{"model_type": "gpt2", "n_embd": 32}')
    export(trained, tmp_path / "opt", "--prefix", "optimizer/state/0", "--config", str(tmp_path / "cfg"))
    tensors = load_file(tmp_path / "opt" / "model.safetensors")
    assert set(tensors) >= {"exp_avg", "exp_avg_sq"}
    assert json.loads((tmp_path / "opt" / "config.json").read_text())["n_embd"] == 32
    missing = CliRunner().invoke(cli, ["export", "main", str(tmp_path / "y"), "--format", "hf", "--repo", trained,
                                       "--config", str(tmp_path / "absent")])
    assert isinstance(missing.exception, FileNotFoundError) and "no config.json" in str(missing.exception)
    assert not (tmp_path / "y").exists(), "nothing is written when the config is missing"
    result = CliRunner().invoke(cli, ["export", "main", str(tmp_path / "x"), "--format", "hf", "--repo", trained,
                                      "--prefix", "nothing"])
    assert isinstance(result.exception, ValueError) and "no tensors under 'nothing'" in str(result.exception)


def test_shard_sizes():
    assert parse_size("5GB") == 5 * 10 ** 9 and parse_size("2GiB") == 2 * 2 ** 30 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="a size is"):
        parse_size("big")
    ws = [Weight(str(i), str(i), n) for i, n in enumerate([30, 30, 50, 200, 10])]
    assert [[w.key for w in g] for g in shard(ws, 100)] == [["0", "1"], ["2"], ["3"], ["4"]]
