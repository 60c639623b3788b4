"""Save and load of a ~1.5 GB training state with forkpoint and its peers, in one run.

State: an MLP of ~125M float32 parameters plus AdamW's two moments (~1.5 GB). Every method
writes to the same disk, makes its files durable (fsync) and loads back into the live
model and optimizer. Methods run interleaved, `--repeats` times; the table shows medians.

    python benchmarks/save_load.py --repeats 5
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

import forkpoint as fp

warnings.filterwarnings("ignore")


def make_state(params_m: int):
    torch.manual_seed(0)
    width = 3200
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return model, opt, nbytes


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


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


def available(methods):
    out = []
    for m in methods:
        if m is TorchSnapshot:
            try:
                import torchsnapshot  # noqa: F401
            except Exception as e:  # peers are optional; report and skip
                print(f"skipping torchsnapshot: {e}", file=sys.stderr)
                continue
        out.append(m())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=int, default=125, help="model size in millions of parameters")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir on /tmp)")
    ap.add_argument("--json", default="bench-out/save_load.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, opt, nbytes = make_state(args.params_m)
    reference = [p.detach().clone() for p in model.parameters()][:2]
    methods = available([Forkpoint, DCP, TorchSave, Safetensors, TorchSnapshot])
    scratch = tempfile.mkdtemp(prefix="fp-bench-", dir=args.dir)
    times = {m.name: {"save": [], "load": []} for m in methods}
    for rep in range(args.repeats):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
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
    print("| method | save (s) | save GB/s | load (s) | load GB/s | save vs dcp | load vs dcp |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for m in methods:
        s, l_ = statistics.median(times[m.name]["save"]), statistics.median(times[m.name]["load"])
        ds, dl = statistics.median(base["save"]), statistics.median(base["load"])
        summary[m.name] = {"save_s": s, "load_s": l_, "runs": times[m.name]}
        print(f"| {m.name} | {s:.2f} | {gb / s:.2f} | {l_:.2f} | {gb / l_:.2f} | {ds / s:.2f}x | {dl / l_:.2f}x |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"bytes": nbytes, "repeats": args.repeats, "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
