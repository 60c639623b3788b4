"""Importing forkpoint imports no framework (not even torch); each plug-in loads its own on use."""

import sys
import procs


def imported_after(code: str) -> set:
    out = procs.run([sys.executable, "-c", code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"],
                    timeout=procs.CHILD_SECONDS)
    assert out.returncode == 0, out.stderr
    import json

    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_forkpoint_loads_no_framework():
    mods = imported_after("import forkpoint as fp\nfp.dist; fp.Repo; fp.adjoint")
    assert not {"torch", "lightning", "transformers", "deepspeed"} & {m.split(".")[0] for m in mods}


def test_each_plugin_loads_only_its_framework():
    mods = {m.split(".")[0] for m in imported_after("import forkpoint as fp\nfp.lightning.CheckpointIO")}
    assert "lightning" in mods and "deepspeed" not in mods
