"""Run a benchmark by name: `python -m benchmarks <name> [options]`; with no name, list them.

Every benchmark prints forkpoint and its peers side by side from one run (medians of
`--repeats`), and takes `--help`. Which figures each one produced, with the command, is in
docs/BENCHMARKS.md.
"""

import ast
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

FAMILIES = {
    "save and load against the peers": ["save_load", "many_leaves", "mmap_load", "persist_throughput", "save_floor"],
    "the training loop's stall": ["train_overhead", "frameworks", "long_run", "open_repos", "scheduler", "sim_stall",
                                  "every_step_bound"],
    "encoding": ["codecs", "compression", "codec_ab", "coder_time", "flush_encode"],
    "tiers and replication": ["tiers_restore", "replication"],
    "distributed and MPI": ["dist_save", "mpi_io"],
    "history and storage used": ["finetune_frozen", "retention_disk", "ui_lineage", "hf_export"],
    "resilience, adjoints, activations": ["failure_sim", "adjoint", "activation_memory"],
    "the C library": ["c_io"],
    "the code itself": ["tree_size"],
}
"""What each benchmark measures, by family: the listing's headings (a script named in none is
listed under "other")."""


def benchmarks() -> dict[str, str]:
    """{name: the first line of its docstring} of every benchmark script here."""
    found = {}
    for entry in sorted(os.listdir(HERE)):
        if entry.endswith(".py") and not entry.startswith("_") and entry != "harness.py":
            with open(os.path.join(HERE, entry)) as f:
                doc = ast.get_docstring(ast.parse(f.read())) or ""
            found[entry[:-3]] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def main(argv: list[str]) -> int:
    known = benchmarks()
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, known))
        print("usage: python -m benchmarks <name> [options]   (each takes --help)")
        for family, names in [*FAMILIES.items(), ("other", sorted(set(known) - {n for v in FAMILIES.values() for n in v}))]:
            names = [n for n in names if n in known]
            if names:
                print(f"\n{family}:")
            for name in names:
                print(f"  {name:<{width}}  {known[name]}")
        return 0
    name = argv[0].replace("-", "_")
    if name not in known:
        print(f"no benchmark {argv[0]!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    sys.path.insert(0, HERE)
    sys.argv = [os.path.join(HERE, f"{name}.py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
