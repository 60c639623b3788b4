"""Repositories on a real S3-compatible server (moto in server mode, started here)."""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.engine.autocodec import choice_for
from conftest import race_before_publish
from forkpoint.errors import CorruptObjectError
from forkpoint.storage.remote import FsspecStore

pytest.importorskip("s3fs")
pytest.importorskip("moto")

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free port, answering; (its process, its URL)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, **CREDS))
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError("moto server exited")
            time.sleep(0.1)
    return proc, url


@pytest.fixture(scope="module")
def endpoint():
    proc, url = start_moto()
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def s3(endpoint, monkeypatch, request):
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
    bucket = f"b{abs(hash(request.node.name)) % 10**10}"
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir(bucket)
    return f"s3://{bucket}/runs/exp1", opts


def test_round_trip_refs_and_restore_on_s3(s3):
    url, opts = s3
    repo = fp.Repo(url, create=True, storage_options=opts)
    model = torch.nn.Linear(300, 300)
    big = torch.randn(3_000_000)
    v1 = repo.save({"model": model, "big": big, "step": 1}, step=1, metrics={"loss": 0.5})
    with torch.no_grad():
        model.weight.add_(1)
    v2 = repo.save({"model": model, "big": big, "step": 2}, step=2)
    assert v2.stored_bytes < 1_000_000, "the unchanged large leaf is deduplicated"
    fresh = fp.Repo(url, storage_options=opts)
    assert [v.id for v in fresh.log()] == [v2.id, v1.id]
    out = fresh.load("main~1")
    assert torch.equal(out["big"], big) and out["step"] == 1
    m2 = torch.nn.Linear(300, 300)
    fresh.restore({"model": m2, "big": torch.zeros(3_000_000), "step": 0}, "main")
    assert torch.equal(m2.weight, model.weight)
    fresh.fork("main~1", "alt")
    fresh.tag("first", v1.id)
    assert set(fresh.branches()) == {"main", "alt"} and fresh.version("first").id == v1.id
    assert fresh.verify().ok


def test_conditional_put_makes_refs_race_free(s3):
    url, opts = s3
    store = FsspecStore(url, **opts)
    assert store.create_exclusive("refs/heads/x/0000000000000000.json", b"a")
    assert not store.create_exclusive("refs/heads/x/0000000000000000.json", b"b")
    assert store.conditional_put, "the server honoured If-None-Match"
    assert store.read("refs/heads/x/0000000000000000.json") == b"a"


def test_gc_and_corruption_on_s3(s3):
    url, opts = s3
    repo = fp.Repo(url, create=True, storage_options=opts)
    for s in range(4):
        repo.save({"w": np.full(500_000, s, dtype=np.float32)}, step=s)
    report = repo.gc(keep=fp.Keep(last=1), grace=0)
    assert len(report.pruned_versions) == 3 and report.deleted_objects == 3
    assert np.all(repo.load()["w"] == 3)
    obj = repo.manifest().leaves[0].chunks[0].object
    key = f"objects/{obj[:2]}/{obj}"
    data = bytearray(repo.store.read(key))
    data[-5] ^= 1
    repo.store.write(key, [bytes(data)])
    with pytest.raises(CorruptObjectError, match=obj):
        fp.Repo(url, storage_options=opts).load()


def test_compact_and_encode_later_on_s3(s3):
    """Objects are re-encoded in place with one whole-object PUT (no rename on S3)."""
    url, opts = s3
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(1_000_000) * 0.02).astype(np.float32)
    repo = fp.Repo(url, create=True, storage_options=opts)
    v = repo.save({"w": w})
    report = repo.compact(codec="lossless")
    assert report.encoded == 1 and report.saved_bytes > 0 and not report.problems
    assert repo.du()["codecs"].keys() == {"float-planes"}
    later = fp.Repo(url, storage_options=opts, codec="lossless", encode_later=True)
    choice_for(later.store).rates = {False: 1e15, True: 1.0}
    v2 = later.save({"w": w * 2}, step=2)
    assert v2.stored_bytes > w.nbytes, "the save wrote raw"
    later.drain()
    assert later.du()["codecs"].keys() == {"float-planes"}
    fresh = fp.Repo(url, storage_options=opts)
    assert np.array_equal(fresh.load(v.id)["w"], w) and np.array_equal(fresh.load(v2.id)["w"], w * 2)
    assert fresh.verify().ok


def test_two_writers_on_one_branch_over_s3(s3):
    url, opts = s3
    a = fp.Repo(url, create=True, storage_options=opts)
    b = fp.Repo(url, storage_options=opts)
    race_before_publish(a, lambda: b.save({"who": "b"}, step=1))
    a.save({"who": "a"}, step=1)
    log = fp.Repo(url, storage_options=opts).log()
    assert sorted(fp.Repo(url, storage_options=opts).load(v.id)["who"] for v in log) == ["a", "b"]


def test_ref_records_stay_bounded_on_s3(s3):
    from forkpoint.repo.refs import REF_RECORDS_KEPT

    url, opts = s3
    repo = fp.Repo(url, create=True, storage_options=opts)
    for i in range(2 * REF_RECORDS_KEPT + 2):
        v = repo.save({"i": i}, step=i)
    records = repo.store.list("refs/heads/main")
    assert REF_RECORDS_KEPT <= len(records) < 2 * REF_RECORDS_KEPT
    fresh = fp.Repo(url, storage_options=opts)
    assert fresh.head("main") == v.id and len(fresh.log("main")) == 2 * REF_RECORDS_KEPT + 2


def test_memory_tier_flushes_to_s3_and_survives_losing_memory(s3):
    import uuid

    url, opts = s3
    fast = f"mem://{uuid.uuid4().hex}"
    repo = fp.Repo(tiers=[fp.tier(fast, keep=1), fp.tier(url, **opts)], create=True)
    for s in range(3):
        repo.save({"w": np.full(400_000, s, dtype=np.float32), "s": s}, step=s)
    repo.close()
    remote = fp.Repo(url, storage_options=opts)
    assert [v.step for v in remote.log()] == [2, 1, 0]
    assert all(np.all(remote.load(v.id)["w"] == v.step) for v in remote.log())
    again = fp.Repo(tiers=[f"mem://{uuid.uuid4().hex}", fp.tier(url, **opts)])
    assert again.load("main")["s"] == 2 and again.where("main") == [url]
    again.close()


def test_lossless_saves_to_s3_encode_every_chunk_unpaced(s3):
    """Remote stores are slow next to encoding: a lossless save there encodes every chunk, even
    the first ones, which a paced save to local disk writes raw while nothing waits."""
    url, opts = s3
    repo = fp.Repo(url, create=True, storage_options=opts, codec="lossless")
    assert repo.scheduler.limit("io:tier0") * 2 <= 16
    state = {f"w{i}": torch.randn(1 << 18) for i in range(16)}
    version = repo.save(state)
    assert {c.codec for leaf in repo.manifest(version.id).leaves for c in leaf.chunks} == {"float-planes"}
    assert torch.equal(repo.load(version.id)["w7"], state["w7"])
    repo.close()


def test_dedup_reuse_survives_a_gc_of_another_process_on_s3(s3):
    """Another process's gc lists the objects, then a save reuses (touches) an object only a
    version being pruned references and commits, then the gc deletes what its listing showed
    as old: the touch is a real one on S3 and gc re-reads an object's time before deleting it,
    so the new head stays readable."""
    url, opts = s3
    a = fp.Repo(url, create=True, storage_options=opts)
    b = fp.Repo(url, storage_options=opts)
    old = np.full(300_000, 7, dtype=np.float32)
    a.save({"w": old}, step=0)
    a.save({"w": np.zeros(300_000, dtype=np.float32)}, step=1)
    b.save({"other": 1}, branch="b")
    time.sleep(6)  # older than the quiet margin and the grace period of the gc below
    real_list, fired = a.store.list, []

    def list_then_reuse(prefix):
        keys = real_list(prefix)
        if prefix == "objects" and not fired:
            fired.append(b.save({"w": old}, branch="b", step=2))
        return keys

    a.store.list = list_then_reuse
    report = a.gc(keep=fp.Keep(last=1), grace=1)
    assert fired and len(report.pruned_versions) == 1
    assert np.array_equal(fp.Repo(url, storage_options=opts).load(fired[0].id)["w"], old)


def test_a_dead_endpoint_fails_a_save_with_a_clear_error(s3, tmp_path):
    """The S3 server killed while saves run: the next save fails within the bound the
    timeouts and retries set (StoreUnavailableError naming the store), it does not hang."""
    from forkpoint.errors import StoreUnavailableError

    proc, endpoint = start_moto()
    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
    import s3fs

    s3fs.S3FileSystem(**opts).mkdir("dying")
    repo = fp.Repo("s3://dying/r", create=True, storage_options=opts)
    state = {"w": np.random.default_rng(0).standard_normal(2_000_000).astype(np.float32)}
    pending = repo.save(state, sync=False)
    time.sleep(0.2)
    proc.kill()
    proc.wait(10)
    try:
        pending.wait()
    except StoreUnavailableError:
        pass
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f"{endpoint}|s3://dying/r"):
        repo.save({"w": state["w"] + 1}, step=2)
    assert time.monotonic() - started < 240


class FaultyProxy:
    """An HTTP proxy in front of the S3 server that fails every `every`-th request (the first
    `limit` such, where given): with a 503, by closing the connection without an answer, or by
    answering only after `stall` seconds."""

    def __init__(self, upstream: str, every: int, fault: str, stall: float = 0.0, limit: int | None = None):
        import http.client
        import http.server
        import threading
        from urllib.parse import urlparse

        self.every, self.fault, self.stall, self.seen, self.faults = every, fault, stall, 0, 0
        self.limit = limit
        self.lock = threading.Lock()
        target = urlparse(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    proxy.seen += 1
                    faulty = proxy.every and proxy.seen % proxy.every == 0 and (
                        proxy.limit is None or proxy.faults < proxy.limit)
                    proxy.faults += bool(faulty)
                if faulty and proxy.fault == "503":
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if faulty and proxy.fault == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if faulty and proxy.fault == "stall":
                    time.sleep(proxy.stall)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = target.netloc
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("fault", ["503", "drop", "stall"])
def test_saves_flushes_and_gc_ride_out_injected_faults(s3, fault):
    """Every 4th request to S3 fails (503, connection dropped, or an answer after the read
    timeout): saves, flushes from a memory tier and gc retry with backoff and finish, and every
    version reads back bit-exact through a clean connection. Stalls are limited to a few, with a
    read timeout well above the server's answer time on a busy machine: else every slow answer
    times out too, and the retries' own stalls make the run as long as the machine is slow."""
    import uuid

    url, opts = s3
    stalls = fault == "stall"
    proxy = FaultyProxy(opts["client_kwargs"]["endpoint_url"], 4, fault, stall=10.0, limit=4 if stalls else None)
    faulty = {**opts, "client_kwargs": {"endpoint_url": proxy.url},
              "config_kwargs": {"read_timeout": 6 if stalls else 60, "connect_timeout": 6,
                                "retries": {"max_attempts": 4}}}
    try:
        repo = fp.Repo(tiers=[fp.tier(f"mem://{uuid.uuid4().hex}", keep=1), fp.tier(url, **faulty)], create=True)
        states = [{"w": np.random.default_rng(s).standard_normal(100_000).astype(np.float32), "s": s}
                  for s in range(3)]
        for s, state in enumerate(states):
            repo.save(state, step=s)
        repo.drain()
        repo.close()
        remote = fp.Repo(url, storage_options=faulty)
        report = remote.gc(keep=fp.Keep(last=2), grace=0)
        assert len(report.pruned_versions) == 1
    finally:
        proxy.close()
    assert proxy.faults >= 3
    clean = fp.Repo(url, storage_options=opts)
    assert [v.step for v in clean.log()] == [2, 1, 0] and clean.verify().ok
    for v in clean.log()[:2]:
        assert np.array_equal(clean.load(v.id)["w"], states[v.step]["w"])


def test_a_store_that_always_fails_commits_nothing(s3):
    """Every request fails with a 503: the save raises StoreUnavailableError once the retries
    are spent, and the repository as the server holds it is unchanged."""
    from forkpoint.errors import StoreUnavailableError

    url, opts = s3
    fp.Repo(url, create=True, storage_options=opts).save({"w": np.ones(1000, np.float32)}, step=0)
    proxy = FaultyProxy(opts["client_kwargs"]["endpoint_url"], 0, "503")
    faulty = {**opts, "client_kwargs": {"endpoint_url": proxy.url},
              "config_kwargs": {"retries": {"max_attempts": 2}}}
    try:
        repo = fp.Repo(url, storage_options=faulty)
        proxy.every = 1
        with pytest.raises(StoreUnavailableError, match="503|failed after retries"):
            repo.save({"w": np.zeros(1000, np.float32)}, step=1)
    finally:
        proxy.close()
    clean = fp.Repo(url, storage_options=opts)
    assert [v.step for v in clean.log()] == [0] and clean.verify().ok


def test_the_ui_serves_a_repository_on_s3_without_writing(s3):
    import json
    import threading
    import urllib.request

    import s3fs

    from forkpoint.cli.webui import serve

    url, opts = s3
    repo = fp.Repo(url, create=True, storage_options=opts)
    for step in range(3):
        repo.save({"x": torch.full((10,), float(step))}, step=step, metrics={"loss": 1.0 / (step + 1)})
    repo.fork("main~1", "alt")
    fs = s3fs.S3FileSystem(**opts)
    before = sorted(fs.find(url))
    server = serve(fp.Repo(url, storage_options=opts), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    page = json.load(urllib.request.urlopen(base + "/api/versions"))
    assert page["total"] == 3 and {r["id"] for r in page["versions"]} == {v.id for v in repo.log("main")}
    detail = json.load(urllib.request.urlopen(base + "/api/version/main"))
    assert detail["metrics"]["loss"] == 1 / 3 and detail["tiers"][0]["holds"]
    series = json.load(urllib.request.urlopen(base + "/api/series?metric=loss"))
    assert series["branches"]["alt"]["fork"]["step"] == 1
    server.shutdown()
    server.server_close()
    fs.invalidate_cache()
    assert sorted(fs.find(url)) == before, "the page only reads"
