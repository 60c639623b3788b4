"""Save and load of a ~1.5 GB training state with forkpoint and its peers, in one run.

State: an MLP of ~125M float32 parameters plus AdamW's two moments (~1.5 GB). Every method
writes to the same disk, makes its files durable (fsync) and loads back into the live
model and optimizer. Methods run interleaved, `--repeats` times; the table shows medians.

    python benchmarks/save_load.py --repeats 5
"""

import gc
import os
import shutil
import statistics
import sys
import time
import warnings

import torch

import forkpoint as fp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import fsync_tree  # noqa: E402

warnings.filterwarnings("ignore")


def make_state(params_m: int):
    """(model, optimizer, bytes of state): the standard MLP with AdamW, after one step."""
    model, opt = harness.mlp_adamw(params_m, stepped=True)
    return model, opt, harness.state_bytes(model)


class Forkpoint:
    name = "forkpoint"

    def save(self, model, opt, path):
        repo = fp.Repo(path, create=True)
        repo.save({"model": model, "optim": opt}, step=1)
        repo.close()

    def load(self, model, opt, path):
        repo = fp.Repo(path)
        repo.restore({"model": model, "optim": opt}, "main")
        repo.close()


class DCP:
    name = "torch.distributed.checkpoint"

    def save(self, model, opt, path):
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)

    def load(self, model, opt, path):
        import torch.distributed.checkpoint as dcp

        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])


class TorchSave:
    name = "torch.save + fsync"

    def save(self, model, opt, path):
        os.makedirs(path)
        with open(os.path.join(path, "ckpt.pt"), "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, model, opt, path):
        sd = torch.load(os.path.join(path, "ckpt.pt"), map_location="cpu", weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])


class Safetensors:
    name = "safetensors + fsync"

    @staticmethod
    def flat(model, opt):
        out = {f"model.{k}": v for k, v in model.state_dict().items()}
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"optim.{i}.{k}"] = v
        return out

    def save(self, model, opt, path):
        from safetensors.torch import save_file

        os.makedirs(path)
        save_file(self.flat(model, opt), os.path.join(path, "ckpt.safetensors"))
        fsync_tree(path)

    def load(self, model, opt, path):
        from safetensors.torch import load_file

        loaded = load_file(os.path.join(path, "ckpt.safetensors"))
        with torch.no_grad():
            for k, v in self.flat(model, opt).items():
                v.copy_(loaded[k])


class TorchSnapshot:
    name = "torchsnapshot"

    def save(self, model, opt, path):
        import torchsnapshot

        torchsnapshot.Snapshot.take(path, app_state={"model": model, "optim": opt})

    def load(self, model, opt, path):
        import torchsnapshot

        torchsnapshot.Snapshot(path).restore(app_state={"model": model, "optim": opt})


METHODS = [Forkpoint, DCP, TorchSave, Safetensors, TorchSnapshot]


def main():
    ap = harness.arguments(__doc__, repeats=5, json_path="bench-out/save_load.json", methods=[m.name for m in METHODS])
    ap.add_argument("--params-m", type=int, default=125, help="model size in millions of parameters")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, opt, nbytes = make_state(args.params_m)
    reference = [p.detach().clone() for p in model.parameters()][:2]
    methods = [m() for m in METHODS if m is not TorchSnapshot or harness.optional("torchsnapshot")]
    methods = harness.only(ap, methods, args.only, always=("torch.distributed.checkpoint",))
    scratch = harness.scratch(args.dir)
    times = {m.name: {"save": [], "load": []} for m in methods}
    for rep, order in harness.rounds(methods, args.repeats):
        for m in order:
            path = os.path.join(scratch, f"{m.name.split()[0]}-{rep}")
            gc.collect()
            t0 = time.perf_counter()
            m.save(model, opt, path)
            times[m.name]["save"].append(time.perf_counter() - t0)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            gc.collect()
            t0 = time.perf_counter()
            m.load(model, opt, path)
            times[m.name]["load"].append(time.perf_counter() - t0)
            params = list(model.parameters())
            assert all(torch.equal(a, b) for a, b in zip(params[:2], reference)), f"{m.name} restored wrong data"
            shutil.rmtree(path)
            print(f"rep {rep} {m.name}: save {times[m.name]['save'][-1]:.2f}s load {times[m.name]['load'][-1]:.2f}s",
                  file=sys.stderr)
    shutil.rmtree(scratch, ignore_errors=True)
    gb = nbytes / 1e9
    base = times["torch.distributed.checkpoint"]
    print(f"\nstate: {gb:.2f} GB ({args.params_m}M params + AdamW), {args.repeats} runs, medians\n")
    summary, rows = {}, []
    ds, dl = statistics.median(base["save"]), statistics.median(base["load"])
    for m in methods:
        s, l_ = statistics.median(times[m.name]["save"]), statistics.median(times[m.name]["load"])
        summary[m.name] = {"save_s": s, "load_s": l_, "runs": times[m.name]}
        rows.append([m.name, f"{s:.2f}", f"{gb / s:.2f}", f"{l_:.2f}", f"{gb / l_:.2f}", f"{ds / s:.2f}x", f"{dl / l_:.2f}x"])
    harness.table(["method", "save (s)", "save GB/s", "load (s)", "load GB/s", "save vs dcp", "load vs dcp"], rows)
    harness.write_json(args.json, {"bytes": nbytes, "repeats": args.repeats, "results": summary})


if __name__ == "__main__":
    main()
