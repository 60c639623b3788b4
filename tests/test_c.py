"""libforkpoint, the C implementation of docs/FORMAT.md, against the Python package: C writes
and Python reads, verifies and diffs; Python writes (every dtype the C API names, packs,
chunks, the lossless codec, deltas) and C reads bit-exact, whole leaves and boxes; damaged and
hostile input is refused by both; mutated manifests and objects never crash the reader, which
runs under AddressSanitizer and UBSan."""

import json
import os
import random
import shutil
import subprocess

import numpy as np
import pytest

import forkpoint as fp
from helpers.cbuild import make as cbuild_make
import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ASan/UBSan findings exit with 99, apart from every status the library returns (0 to 9)
SAN_ENV = {**os.environ, "ASAN_OPTIONS": "exitcode=99:detect_leaks=1", "UBSAN_OPTIONS": "halt_on_error=1:exitcode=99"}
DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32",
          "float64", "complex64", "complex128"]


@pytest.fixture(scope="session")
def cbuild():
    """Build c/ (library, fpc, the sanitizer builds) once."""
    return cbuild_make("all", "a C compiler and libzstd-dev")


def fpc(cbuild, *args, asan=True, check=True):
    exe = os.path.join(cbuild, "fpc-asan" if asan else "fpc")
    done = procs.run([exe, *map(str, args)], env=SAN_ENV, timeout=procs.CHILD_SECONDS)
    assert done.returncode != 99, f"sanitizer finding in fpc {args}:\n{done.stderr}"
    if check:
        assert done.returncode == 0, f"fpc {args} failed ({done.returncode}): {done.stderr}"
    return done


def sample_state(seed=0):
    rng = np.random.default_rng(seed)
    state = {}
    for name in DTYPES:
        dt = np.dtype(name)
        if dt.kind == "b":
            a = rng.random(33) > 0.5
        elif dt.kind in "iu":
            a = rng.integers(0, 100, size=(5, 7)).astype(dt)
        elif dt.kind == "c":
            a = (rng.standard_normal(20) + 1j * rng.standard_normal(20)).astype(dt)
        else:
            a = rng.standard_normal((4, 9)).astype(dt)
        state[name] = a
    # chunked leaves: an Adam-like moment the float codec shrinks, and random weights
    state["big"] = {"moment": (np.abs(rng.standard_normal((1200, 1000))) * 1e-3).astype(np.float32),
                    "weights": rng.standard_normal((600, 700))}
    state["scalar"] = np.array(2.5)  # a 0-d leaf
    state["empty"] = np.zeros((0, 3), np.float32)
    return state


def flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from flat(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", np.asarray(v)


def test_blake3_matches_the_published_vectors(cbuild):
    for exe in ("test_blake3", "test_blake3-asan"):
        done = subprocess.run([os.path.join(cbuild, exe), os.path.join(ROOT, "c", "tests", "blake3_vectors.txt")],
                              capture_output=True, text=True, env=SAN_ENV)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "22 vectors, 0 failures" in done.stdout


def test_c_writes_python_loads_verifies_and_diffs(cbuild, tmp_path):
    state = sample_state()
    specs = []
    for path, a in flat(state):
        f = tmp_path / (path.replace("/", "_") + ".bin")
        np.ascontiguousarray(a).tofile(f)
        specs.append(f"{path}={a.dtype.name}:{'x'.join(map(str, a.shape))}:{f}")
    repo = tmp_path / "repo"
    first = fpc(cbuild, "save", repo, "main", "--step", 10, "--message", "from C", "--metric", "loss=0.125",
                "--meta", '{"solver": "cg", "tol": 1e-08}', "--chunk-bytes", 1 << 20, *specs).stdout.strip()
    # a second version on top: one leaf changed, stored with zstd
    changed = state["int32"] + 1
    changed.tofile(tmp_path / "int32.bin")
    second = fpc(cbuild, "save", repo, "main", "--step", 20, "--codec", "zstd", "--chunk-bytes", 1 << 20,
                 *[s for s in specs if not s.startswith("int32=")], f"int32=int32:5x7:{tmp_path / 'int32.bin'}").stdout.strip()

    r = fp.Repo(str(repo))
    loaded = r.load(first)
    for path, a in flat(state):
        got = loaded
        for key in path.split("/"):
            got = got[key]
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a), path
    head = r.log("main")
    assert [v.id for v in head] == [second, first]
    assert head[1].step == 10 and head[1].message == "from C" and head[1].metrics == {"loss": 0.125}
    assert head[1].meta == {"solver": "cg", "tol": 1e-08} and head[0].parents == [first]
    assert r.verify().problems == []
    changes = {d.path: d for d in r.diff(first, second) if d.status != "same"}
    assert list(changes) == ["int32"] and changes["int32"].max_abs == 1
    assert np.array_equal(r.load("main")["int32"], changed)
    # the chunked leaf really is several chunks, and a leaf of the manifest has C's canonical form
    manifest = json.loads((repo / "versions" / f"{first}.json").read_bytes())
    weights = next(leaf for leaf in manifest["leaves"] if leaf["path"] == "big/weights")
    assert len(weights["chunks"]) > 1
    r.close()


def test_python_writes_c_reads_bit_exact(cbuild, tmp_path):
    state = sample_state(1)
    repo = tmp_path / "repo"
    fp.Repo(str(repo), create=True, chunk_bytes=1 << 20).save(state, step=1)
    lossless = fp.Repo(str(repo), codec="lossless", delta=fp.Delta(max_chain=4), chunk_bytes=1 << 20)
    state["big"]["moment"] = state["big"]["moment"] * np.float32(1.0009765625)
    lossless.save(state, step=2)
    lossless.save(state, step=3, message="same bytes again: deduplicated")
    manifest = json.loads((repo / "versions" / f"{lossless.version('main~1').id}.json").read_bytes())
    codecs = {c["codec"] for leaf in manifest["leaves"] for c in leaf["chunks"]}
    assert "float-planes" in codecs
    assert any(len(leaf["chunks"]) > 1 for leaf in manifest["leaves"])
    assert any(c.get("delta") for leaf in manifest["leaves"] for c in leaf["chunks"])
    lossless.close()

    listing = fpc(cbuild, "ls", repo, "main~1").stdout.splitlines()
    assert {line.split("\t")[0] for line in listing} == {p for p, _ in flat(state)}
    out = tmp_path / "out.bin"
    for path, a in flat(state):
        fpc(cbuild, "read", repo, "main~1", path, out)
        assert out.read_bytes() == np.ascontiguousarray(a).tobytes(), path
    # boxes: inside one chunk, across chunks, a single element
    moment = state["big"]["moment"]
    for off, shape in [((3, 5), (4, 6)), ((200, 0), (900, 1000)), ((1199, 999), (1, 1))]:
        fpc(cbuild, "read", repo, "main", "big/moment", out, ",".join(map(str, off)), ",".join(map(str, shape)))
        box = moment[off[0]:off[0] + shape[0], off[1]:off[1] + shape[1]]
        assert out.read_bytes() == box.tobytes()
    assert "leaves verified" in fpc(cbuild, "verify", repo, "main").stdout
    log = fpc(cbuild, "log", repo, "main").stdout.splitlines()
    assert [line.split("\t")[2] for line in log] == ["3", "2", "1"]
    fpc(cbuild, "tag", repo, "best", "main~2")
    refs = fpc(cbuild, "refs", repo).stdout
    assert "branch\tmain\t" in refs and "tag\tbest\t" in refs
    assert fp.Repo(str(repo)).version("best").step == 1


def test_a_damaged_object_is_refused_by_both(cbuild, tmp_path):
    repo = tmp_path / "repo"
    a = np.arange(300_000, dtype=np.float64)
    a.tofile(tmp_path / "a.bin")
    fpc(cbuild, "save", repo, "main", f"a=float64:300000:{tmp_path / 'a.bin'}")
    obj = next(p for p in (repo / "objects").rglob("*") if p.is_file())
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x40
    obj.write_bytes(bytes(data))
    done = fpc(cbuild, "read", repo, "main", "a", tmp_path / "out.bin", check=False)
    assert done.returncode == 6 and "does not match its hash" in done.stderr
    # a box read goes through the block table: the damaged block is named
    done = fpc(cbuild, "read", repo, "main", "a", tmp_path / "out.bin", "150000", "10", check=False)
    assert done.returncode == 6 and "block 1 does not match" in done.stderr
    assert fp.Repo(str(repo)).verify().problems
    obj.write_bytes(bytes(data[:100]))  # truncated
    done = fpc(cbuild, "read", repo, "main", "a", tmp_path / "out.bin", check=False)
    assert done.returncode == 6 and "truncated" in done.stderr


def test_bad_input_gets_clear_errors(cbuild, tmp_path):
    done = fpc(cbuild, "ls", tmp_path / "nowhere", "main", check=False)
    assert done.returncode == 3 and "no forkpoint repository" in done.stderr
    repo = tmp_path / "repo"
    (tmp_path / "a.bin").write_bytes(np.ones(6, np.float32).tobytes())
    vid = fpc(cbuild, "save", repo, "main", f"a=float32:2x3:{tmp_path / 'a.bin'}").stdout.strip()
    done = fpc(cbuild, "ls", repo, "nosuch", check=False)
    assert done.returncode == 3 and "no branch, tag or version 'nosuch'" in done.stderr
    done = fpc(cbuild, "ls", repo, "main~1", check=False)
    assert done.returncode == 3 and "past the first version" in done.stderr
    done = fpc(cbuild, "read", repo, "main", "b", tmp_path / "o", check=False)
    assert done.returncode == 3 and "has no leaf 'b'" in done.stderr
    done = fpc(cbuild, "read", repo, "main", "a", tmp_path / "o", "1,1", "2,2", check=False)
    assert done.returncode == 1 and "does not fit" in done.stderr
    done = fpc(cbuild, "save", repo, "bad name", f"a=float32:2x3:{tmp_path / 'a.bin'}", check=False)
    assert done.returncode == 1 and "invalid branch name" in done.stderr
    done = fpc(cbuild, "save", repo, "main", f"a=float32:4x3:{tmp_path / 'a.bin'}", check=False)
    assert done.returncode == 1 and "fewer than the 48 bytes" in done.stderr
    done = fpc(cbuild, "save", repo, "main", "--metric", "loss=nan", f"a=float32:2x3:{tmp_path / 'a.bin'}", check=False)
    assert done.returncode == 1 and "not finite" in done.stderr
    done = fpc(cbuild, "save", repo, "main", f"a=float32:2x3:{tmp_path / 'a.bin'}", f"a/b=float32:2x3:{tmp_path / 'a.bin'}",
               check=False)
    assert done.returncode == 1 and "collides" in done.stderr
    assert fp.Repo(str(repo)).log("main")[0].id == vid  # nothing committed by the failed saves
    # an edited manifest, a newer format, a manifest that is not JSON
    path = repo / "versions" / f"{vid}.json"
    good = path.read_bytes()
    path.write_bytes(good.replace(b'"step":null', b'"step":7'))
    done = fpc(cbuild, "ls", repo, "main", check=False)
    assert done.returncode == 6 and "does not match its id" in done.stderr
    path.write_bytes(good.replace(b'"format_version":[1,3]', b'"format_version":[2,0]'))
    done = fpc(cbuild, "ls", repo, "main", check=False)
    assert done.returncode == 5 and "upgrade libforkpoint" in done.stderr
    path.write_bytes(good[:len(good) // 2])
    done = fpc(cbuild, "ls", repo, "main", check=False)
    assert done.returncode == 4 and "not valid JSON" in done.stderr


def test_a_branch_held_by_a_live_run_is_refused(cbuild, tmp_path):
    repo = tmp_path / "repo"
    r = fp.Repo(str(repo), create=True)
    ck = fp.Checkpointer(r, {"w": np.zeros(3)}, every=1000)
    (tmp_path / "a.bin").write_bytes(np.ones(3).tobytes())
    done = fpc(cbuild, "save", repo, "main", f"a=float64:3:{tmp_path / 'a.bin'}", check=False)
    assert done.returncode == 7 and "is held by run" in done.stderr
    fpc(cbuild, "save", repo, "side", f"a=float64:3:{tmp_path / 'a.bin'}")
    ck.close()
    r.close()


def test_c_never_gives_a_branch_and_a_tag_one_name(cbuild, tmp_path):
    """As in Python: fpc refuses a tag named like a branch and a save that would create a
    branch named like a tag (the name reads as the branch first), and writes nothing."""
    repo = tmp_path / "repo"
    (tmp_path / "a.bin").write_bytes(np.ones(3).tobytes())
    fpc(cbuild, "save", repo, "main", f"a=float64:3:{tmp_path / 'a.bin'}")
    fpc(cbuild, "tag", repo, "best", "main")
    done = fpc(cbuild, "tag", repo, "main", "main", check=False)
    assert done.returncode == 1 and "'main' is a branch" in done.stderr, done.stderr
    done = fpc(cbuild, "save", repo, "best", f"a=float64:3:{tmp_path / 'a.bin'}", check=False)
    assert done.returncode == 1 and "'best' is a tag" in done.stderr, done.stderr
    r = fp.Repo(str(repo))
    assert set(r.branches()) == {"main"} and set(r.tags()) == {"best"} and len(r.version_ids()) == 1
    r.close()


def mutations(data: bytes, rng: random.Random, count: int):
    """Mutated copies of `data`: flipped bits, truncations, inserted and overwritten bytes, digits changed."""
    for _ in range(count):
        b = bytearray(data)
        kind = rng.randrange(5)
        at = rng.randrange(len(b))
        if kind == 0:
            b[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del b[at:]
        elif kind == 2:
            b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif kind == 3:
            b[at:at + 4] = rng.choice([b"9999", b"-1,0", b"null", b"\xff\xfe", b"1e99", b"[[[["])
        else:
            digits = [i for i, c in enumerate(b) if 48 <= c <= 57]
            if digits:
                b[rng.choice(digits)] = rng.randrange(48, 58)
        yield bytes(b)


def test_mutated_manifests_and_objects_never_crash_the_reader(cbuild, tmp_path):
    """A bounded fuzz run (FORKPOINT_C_FUZZ mutations of each file, 120 by default) of the C reader
    under AddressSanitizer and UBSan: every outcome is a status with a message, or correct bytes."""
    count = int(os.environ.get("FORKPOINT_C_FUZZ", "120"))
    base = tmp_path / "base"
    rng_np = np.random.default_rng(3)
    state = {"w": (np.abs(rng_np.standard_normal((300, 500))) * 1e-2).astype(np.float32),
             "small": np.arange(40, dtype=np.int16), "v": rng_np.standard_normal(200_000)}
    fp.Repo(str(base), create=True, codec="lossless", chunk_bytes=1 << 20).save(state, step=1)
    files = [p for p in base.rglob("*") if p.is_file() and ("objects" in p.parts or "versions" in p.parts)]
    rng = random.Random(7)
    outcomes = {}
    work = tmp_path / "work"
    for target in files:
        original = target.read_bytes()
        for mutated in mutations(original, rng, count if "versions" in target.parts else max(1, count // 4)):
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(base, work)
            (work / target.relative_to(base)).write_bytes(mutated)
            done = fpc(cbuild, "verify", work, "main", check=False)
            assert done.returncode in (0, 1, 3, 4, 5, 6, 9), done.stderr
            assert done.returncode == 0 or done.stderr.startswith("fpc: "), done.stderr
            outcomes[done.returncode] = outcomes.get(done.returncode, 0) + 1
    assert outcomes.get(6, 0) and outcomes.get(4, 0)  # damage found as corruption and as format errors


def test_the_documented_program_compiles_and_its_version_loads_in_python(cbuild, tmp_path):
    page = open(os.path.join(ROOT, "docs", "C.md")).read()
    source = page.split("```c\n", 1)[1].split("```", 1)[0]
    (tmp_path / "save_load.c").write_text(source)
    exe = tmp_path / "save_load"
    subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", "-I", os.path.join(ROOT, "c", "include"), "save_load.c",
                    os.path.join(cbuild, "libforkpoint.a"), "-lzstd", "-lpthread", "-o", str(exe)], cwd=tmp_path, check=True)
    done = subprocess.run([str(exe)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "u[1][2] = 1.2" in done.stdout
    repo = fp.Repo(str(tmp_path / "runs" / "heat"))
    u = repo.load("main")["field"]["u"]
    assert u.shape == (4, 5) and u[1, 2] == 1.2 and repo.log()[0].metrics == {"residual": 1.5e-06}
    assert repo.log()[0].meta == {"solver": "jacobi"} and repo.log()[0].step == 100


def test_fortran_module_round_trips_arrays_python_sees_the_same_bytes(tmp_path):
    build = cbuild_make("fortran", "gfortran, a C compiler and libzstd-dev")
    repo = tmp_path / "repo"
    done = procs.run([os.path.join(build, "fortran_roundtrip"), str(repo)], timeout=procs.CHILD_SECONDS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bit-exact" in done.stdout
    # a wrong shape is refused, naming what the leaf holds
    assert "reading cells into t: 1 'cells' in version" in done.stdout and "is int32 [2, 3, 2]" in done.stdout
    r = fp.Repo(str(repo))
    state = r.load("main")
    i, j = np.meshgrid(np.arange(1, 6), np.arange(1, 4), indexing="ij")
    t = 10.0 * i + j + 0.25  # t(i, j) of the program, a 5 x 3 Fortran array
    assert state["field"]["t"].dtype == np.float64 and np.array_equal(state["field"]["t"], t.T)
    assert np.array_equal(state["field"]["w"], np.array([1.5, -2.0, 3.25, 0.0], np.float32))
    cells = np.arange(1, 13, dtype=np.int32).reshape((2, 3, 2), order="F")  # reshape(1..12, [2, 3, 2])
    assert np.array_equal(state["cells"], np.ascontiguousarray(cells.T))
    assert int(state["step"]) == 42 and r.log()[0].step == 42 and r.log()[0].metrics == {"residual": 1e-6}
    assert r.verify().problems == []
    r.close()
