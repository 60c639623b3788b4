"""The `forkpoint` command: inspect and manage a repository from the shell.

Read commands print for humans by default and JSON with `--json`; long operations show
a progress bar on a terminal.
"""

import sys
from dataclasses import asdict

import click
from rich.console import Console
from rich.table import Table

from ..errors import ForkpointError
from ..repo import Repo
from .common import _emit, _open, _size, _working, console, json_option, repo_option
from .graph import newest_first, render_graph
from .storage_commands import compact, du, gc, verify
from .webapi import reachable

@click.group()
@click.version_option(package_name="forkpoint")
def cli():
    """forkpoint: versioned, lineage-aware checkpoints."""


@cli.command()
@click.argument("path")
def init(path):
    """Create an empty repository at PATH."""
    Repo(path, create=True).close()
    click.echo(f"initialised forkpoint repository at {path}")


@cli.command()
@click.argument("ref", required=False)
@click.option("--limit", "-n", type=int, default=None, help="at most N versions")
@repo_option
@json_option
def log(ref, limit, repo_url, as_json):
    """Show history: REF's first-parent chain, or every branch and tag as a graph."""
    repo = _open(repo_url)
    heads, tags = repo.branches(), repo.tags()
    if ref:
        versions = repo.log(ref, limit=limit)
    else:
        versions = newest_first(list(reachable(repo, [*heads, *tags]).values()))[:limit]
    if as_json:
        return _emit([{**v.summary(),
                       "branches": sorted(b for b, vid in heads.items() if vid == v.id),
                       "tags": sorted(t for t, vid in tags.items() if vid == v.id)} for v in versions])
    if not versions:
        click.echo("no versions")
        return
    for line in render_graph(versions, heads, tags):
        console.print(line)


@cli.command()
@click.argument("ref", default="main")
@repo_option
@json_option
def show(ref, repo_url, as_json):
    """Show one version: record, environment and leaf table (codecs as stored now)."""
    repo = _open(repo_url)
    m = repo.manifest(ref)
    v = m.version
    now = repo.stored_codecs(v.id)
    leaves = [{"path": leaf.path, "kind": leaf.kind, "dtype": leaf.dtype, "shape": leaf.shape,
               "nbytes": leaf.nbytes, "chunks": len(leaf.chunks),
               "codecs": sorted({("delta:" if c.delta else "") + now.get(c.object, c.codec) for c in leaf.chunks}),
               "alias_of": None if leaf.alias_of is None else m.leaves[leaf.alias_of].path,
               "lossy": leaf.lossy}
              for leaf in m.leaves]
    if as_json:
        return _emit({**v.summary(), "classes": m.classes, "leaves": leaves})
    console.print(f"[bold]version {v.id}[/bold]" + (" [red](pruned)[/red]" if v.pruned else ""))
    for key in ("branch", "step", "parents", "message", "metrics", "meta"):
        console.print(f"  {key:8} {getattr(v, key)}")
    console.print(f"  {'bytes':8} logical {_size(v.logical_bytes)}, newly stored {_size(v.stored_bytes)}")
    console.print(f"  {'env':8} " + ", ".join(f"{k}={val}" for k, val in v.env.items()))
    if m.classes:
        console.print(f"  {'objects':8} " + ", ".join(f"{p}={c.replace(':', '.')}" for p, c in m.classes.items()),
                      markup=False)
    held = set(repo.where(v.id))
    for i, t in enumerate(v.tiers):
        where = "each node's own" if t.get("local") else ("holds it" if t["url"] in held else "does not hold it now")
        console.print(f"  {'tier ' + str(i):8} {t['url']} (keep {t['keep'] or 'all'}, flush every "
                      f"{t['flush_every']}{', node-local' if t.get('local') else ''}): {where}")
    table = Table("path", "kind", "dtype", "shape", "size", "chunks", "codec")
    for leaf in leaves:
        table.add_row(leaf["path"], leaf["kind"], leaf["dtype"], "x".join(map(str, leaf["shape"])) or "()",
                      _size(leaf["nbytes"]),
                      f"= {leaf['alias_of']}" if leaf["alias_of"] else str(leaf["chunks"]),
                      ",".join(leaf["codecs"]))
    console.print(table)
    lossy = [leaf for leaf in leaves if leaf["lossy"]]
    if lossy:
        table = Table("LOSSY leaf", "mode", "significand bits kept", "max relative error (measured)")
        for leaf in lossy:
            info = leaf["lossy"]
            table.add_row(leaf["path"], info["mode"], str(info["keep_bits"]), f"{info['max_rel_error']:.3g}")
        console.print(table)


@cli.command()
@click.argument("a")
@click.argument("b")
@click.option("--all", "show_all", is_flag=True, help="list unchanged leaves too")
@repo_option
@json_option
def diff(a, b, show_all, repo_url, as_json):
    """Compare two versions leaf by leaf."""
    rows = _open(repo_url).diff(a, b)
    if as_json:
        return _emit([asdict(d) for d in rows])
    table = Table("path", "status", "detail", "max |a-b|", "rel L2")
    for d in rows:
        if d.status == "same" and not show_all:
            continue
        color = {"same": "dim", "changed": "yellow", "added": "green", "removed": "red"}[d.status]
        table.add_row(d.path, f"[{color}]{d.status}[/{color}]", d.detail,
                      "" if d.max_abs is None else f"{d.max_abs:.3g}",
                      "" if d.rel_l2 is None else f"{d.rel_l2:.3g}")
    same = sum(d.status == "same" for d in rows)
    console.print(table)
    console.print(f"{len(rows) - same} of {len(rows)} paths differ")


@cli.command()
@click.argument("ref")
@click.argument("name")
@repo_option
def fork(ref, name, repo_url):
    """Create branch NAME at REF."""
    v = _open(repo_url).fork(ref, name)
    click.echo(f"branch {name} created at {v.id} (step {v.step})")


@cli.command()
@click.argument("name")
@click.argument("ref", default="main")
@click.option("--force", is_flag=True, help="move an existing tag")
@click.option("--delete", is_flag=True, help="delete the tag")
@repo_option
def tag(name, ref, force, delete, repo_url):
    """Tag REF as NAME (tagged versions survive retention)."""
    repo = _open(repo_url)
    if delete:
        repo.delete_tag(name)
        click.echo(f"tag {name} deleted")
        return
    v = repo.tag(name, ref, force=force)
    click.echo(f"tag {name} -> {v.id} (step {v.step})")


@cli.group()
def branch():
    """Repair or remove a branch."""


@branch.command("reset")
@click.argument("name")
@click.argument("ref")
@repo_option
def branch_reset(name, ref, repo_url):
    """Point branch NAME at REF (e.g. its last intact version), whatever its head holds now."""
    v = _open(repo_url).reset_branch(name, ref)
    click.echo(f"branch {name} -> {v.id} (step {v.step})")


@branch.command("delete")
@click.argument("name")
@repo_option
def branch_delete(name, repo_url):
    """Delete branch NAME (its versions stay until gc finds them unreachable)."""
    _open(repo_url).delete_branch(name)
    click.echo(f"branch {name} deleted")


@cli.command()
@repo_option
@json_option
def branches(repo_url, as_json):
    """List branches and their heads."""
    repo = _open(repo_url)
    heads = repo.branches()
    if as_json:
        return _emit(heads)
    for name, vid in heads.items():
        v = repo.version(vid)
        click.echo(f"{name:20} {vid[:12]}  step {v.step}")


@cli.command()
@repo_option
@json_option
def tags(repo_url, as_json):
    """List tags and the versions they name."""
    repo = _open(repo_url)
    named = repo.tags()
    if as_json:
        return _emit({name: {"id": vid, "step": repo.version(vid).step} for name, vid in named.items()})
    if not named:
        click.echo("no tags (make one with `forkpoint tag NAME REF`)")
    for name, vid in sorted(named.items()):
        v = repo.version(vid)
        click.echo(f"{name:20} {vid[:12]}  step {v.step}  branch {v.branch}")


@cli.command()
@click.argument("ref")
@click.argument("directory")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "dcp", "hf"]), default="safetensors",
              show_default=True, help="safetensors files + state.json, a PyTorch DCP directory, or a Hugging "
                                      "Face model directory (the weights under --prefix, sharded)")
@click.option("--prefix", default=None, help="(hf) the path of the model's weights in the state "
                                             "[default: model, else the whole state]")
@click.option("--max-shard-size", default="5GB", show_default=True, help="(hf) largest shard: 5GB, 500MB, 2GiB")
@click.option("--config", "hf_config", default=None,
              help="(hf) config.json to copy, or a directory with it [default: the version's hf_config]")
@click.option("--allow-pickle", is_flag=True, help="also unpickle leaves stored with pickle")
@click.option("--keep-prefix", is_flag=True,
              help="name tensors in <key>.safetensors by their whole path (model/0.bias), not the "
                   "path below the key (0.bias, what model.load_state_dict expects)")
@repo_option
def export(ref, directory, fmt, prefix, max_shard_size, hf_config, allow_pickle, keep_prefix, repo_url):
    """Write REF as safetensors files (one per top-level key) plus state.json, as a DCP directory,
    or as a Hugging Face model directory."""
    if fmt == "hf":
        from .hf_export import export_hf, parse_size

        try:
            shard_bytes = parse_size(max_shard_size)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--max-shard-size") from None
        with _working(f"exporting {ref} as a Hugging Face model directory"):
            files = export_hf(_open(repo_url), ref, directory, prefix=prefix, max_shard_bytes=shard_bytes,
                              config=hf_config)
    elif fmt == "dcp":
        from .convert import export_dcp

        with _working(f"exporting {ref} as a DCP checkpoint"):
            files = export_dcp(_open(repo_url), ref, directory, allow_pickle=allow_pickle)
    else:
        from .export import export_version

        with _working(f"exporting {ref} as safetensors"):
            files = export_version(_open(repo_url), ref, directory, allow_pickle=allow_pickle,
                                   keep_prefix=keep_prefix)
    for f in files:
        click.echo(f)


@cli.command("import")
@click.argument("source")
@click.option("--format", "fmt", type=click.Choice(["auto", "dcp", "torch", "safetensors"]), default="auto",
              show_default=True, help="DCP directory, torch.save file, or safetensors file/directory")
@click.option("--branch", default="main", show_default=True)
@click.option("--step", type=int, default=None)
@click.option("-m", "--message", default="")
@click.option("--allow-pickle", is_flag=True, help="load pickled objects in the source (trusted sources only)")
@repo_option
def import_(source, fmt, branch, step, message, allow_pickle, repo_url):
    """Save the checkpoint at SOURCE as a new version on BRANCH."""
    from .convert import import_source

    try:
        with _working(f"importing {source}"):
            version, skipped = import_source(_open(repo_url), source, fmt, branch, step, message, allow_pickle)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{version.id} on {branch} (step {version.step})")
    if skipped:
        click.echo(f"left out {len(skipped)} entries that only a full unpickler reads (use --allow-pickle "
                   "to import them, for a trusted source): "
                   + ", ".join(skipped[:10]))


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--steps", "-k", type=click.IntRange(1), default=3, show_default=True,
              help="steps before the checkpoint")
@click.option("--then", "-j", type=click.IntRange(1), default=3, show_default=True,
              help="steps compared after it")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def audit(steps, then, command):
    """Prove a resume exact: run COMMAND (a script using a Checkpointer) three times, checkpoint
    after STEPS steps, resume in a fresh process, compare the next THEN steps bit for bit.

    \b
    forkpoint audit --steps 5 --then 5 -- python train.py --repo runs/x
    """
    from ..automation.audit import audit_command

    try:
        report = audit_command(list(command), steps, then)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(report))
    sys.exit(0 if report.exact else 1)


@cli.command()
@repo_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (another than 127.0.0.1 lets other machines read the repository)")
@click.option("--port", "-p", type=click.IntRange(0, 65535), default=8765, show_default=True, help="0: any free port")
def ui(repo_url, host, port):
    """Serve a read-only web page of the repository: lineage, metrics, diffs, usage."""
    from .webui import serve

    server = serve(_open(repo_url), host, port)
    click.echo(f"forkpoint ui for {repo_url} at http://{host}:{server.server_address[1]}/ (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@cli.command()
@click.argument("metric")
@click.option("--branches", "-b", "branch_names", multiple=True, help="branches to plot (default: all)")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="image file (.png, .svg, .pdf)")
@click.option("--log-y", is_flag=True, help="logarithmic y axis")
@repo_option
def plot(metric, branch_names, out, log_y, repo_url):
    """Plot METRIC over step for each branch, fork points marked, into an image file."""
    from .plot import plot_metric

    try:
        drawn = plot_metric(_open(repo_url), metric, out, list(branch_names) or None, log_y)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{out}: {metric} of {', '.join(drawn)}")


@cli.command()
@click.option("--dir", "directory", default="demo-repo", show_default=True, help="where to put the demo repository")
@click.option("--steps", default=60, show_default=True)
def demo(directory, steps):
    """Train, get killed, resume exactly, fork with another learning rate, show log and diff."""
    from .demo import run_demo

    run_demo(directory, steps, console)


for command in (verify, compact, gc, du):
    cli.add_command(command)


def main():
    try:
        cli(standalone_mode=True)
    except (ForkpointError, ValueError) as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}")
        sys.exit(2)


if __name__ == "__main__":
    main()
