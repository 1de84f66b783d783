"""The local hub's demo content: small GGUF shards with real split metadata, and an engine release archive that
is clearly a demo (``python -m engine_manager.testing.hub --demo DIR`` serves them; the download tests use them),
and the hub's command line (:func:`main`).
Shard names come from :func:`engine_manager.gguf_split.shard_name`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..gguf_split import shard_name

if TYPE_CHECKING:
    from .hub import LocalHub


def write_demo_shards(folder: Path, *, count: int = 7, bytes_per_shard: int = 1 << 20, seed: int = 41,
                      stem: str = "DeepSeek-V4.1-Flash-Q2_K", split_no_override: dict[int, int] | None = None
                      ) -> list[Path]:
    """Write ``count`` small GGUF files named like the model's shards, each with the split keys
    (``split.no``, ``split.count``, ``split.tensors.count``) and one tensor of seeded random bytes.
    They are download fixtures, not a model."""
    import numpy as np
    from gguf import GGUFWriter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        p = folder / shard_name(stem, i + 1, count)
        w = GGUFWriter(str(p), "deepseek2")
        w.add_uint16("split.no", (split_no_override or {}).get(i, i))
        w.add_uint16("split.count", count)
        w.add_int32("split.tensors.count", count)
        w.add_string("general.name", "dsv41 download fixture (not a model)")
        n = max(32, bytes_per_shard - 512)
        w.add_tensor(f"fixture.{i}.bytes", rng.integers(-128, 127, size=n, dtype=np.int8))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out.append(p)
    return out


def write_demo_release(path: Path, version: str = "v0.1.0") -> Path:
    """A small .tar.gz laid out like an engine release (a marked executable inside), clearly a demo."""
    import io
    import tarfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    script = ("#!/bin/sh\necho 'dsv41 local hub demo release " + version +
              ": not the Strata engine, only a download fixture' >&2\nexit 2\n").encode()
    readme = b"This archive comes from the dsv41 local hub (python -m engine_manager.testing.hub --demo).\n"
    with tarfile.open(path, "w:gz") as tar:
        root = f"strata-{version}"
        for name, data, mode in ((f"{root}/bin/strata-demo", script, 0o755),
                                 (f"{root}/DEMO-RELEASE.txt", readme, 0o644)):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), mode, int(time.time())
            tar.addfile(ti, io.BytesIO(data))
    return path


def release_manifest(hub: "LocalHub", archive: Path, version: str = "v0.1.0",
                     url_path: str | None = None) -> dict[str, Any]:
    """Serve ``archive`` on the hub and return an engine manifest that points at it."""
    url_path = url_path or f"/deepseek-one-gpu/releases/download/{version}/{archive.name}"
    f = hub.add_raw(url_path, Path(archive))
    return {"name": "strata", "version": version, "url": hub.raw_url(url_path), "size": f.size,
            "sha256": f.sha256, "executables": ["bin/strata-demo"],
            "note": "local hub demo release (not the engine)"}


def _cached_sha256(folder: Path, files: Iterable[Path]) -> dict[str, str]:
    """sha256 of each file, cached in ``folder/.hub-sha256.json`` keyed by name, size and mtime (replica shards
    are tens of GB: hash them once)."""
    cache_path = folder / ".hub-sha256.json"
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    out = {}
    for p in files:
        st = p.stat()
        key = f"{p.name}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            print(f"hub: hashing {p.name} ({st.st_size / 1e9:.2f} GB)…", file=sys.stderr, flush=True)
            from ..hashing import sha256_file

            cache[key] = sha256_file(p)
        out[p.name] = cache[key]
    try:
        cache_path.write_text(json.dumps(cache, indent=1))
    except OSError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    from ..settings import DEFAULT_MODEL_REPO

    p = argparse.ArgumentParser(prog="python -m engine_manager.testing.hub",
                                description="A local Hugging Face hub on 127.0.0.1 for tests and demos. Point "
                                            "HF_ENDPOINT at the URL it prints.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--repo", default=DEFAULT_MODEL_REPO, help="repository id to serve the files as")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--dir", type=Path, help="serve every file of this folder (e.g. sparse replica shards)")
    src.add_argument("--demo", type=Path, metavar="DIR",
                     help="write seven small GGUF shards and a demo engine release into DIR and serve them")
    src.add_argument("--replica", type=Path, metavar="DIR",
                     help="write the planner's sparse replica of the real split into DIR (engine_manager.replica) "
                          "and serve it")
    p.add_argument("--demo-size-mib", type=float, default=4.0, help="size of each demo shard (MiB)")
    p.add_argument("--token", help="require this bearer token (like a gated repo)")
    p.add_argument("--no-redirect", action="store_true", help="serve LFS files directly, without the CDN 302")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="e.g. drop:at=1048576,path=*00002*  stall:at=0,seconds=30  corrupt:at=100,length=8  "
                        "status:status=503,times=2  slow:rate_bps=5e6,times=inf")
    args = p.parse_args(argv)

    from .hub import Fault, LocalHub

    hub = LocalHub(args.host, args.port, token=args.token, redirect_lfs=not args.no_redirect)
    repo = hub.repo(args.repo)
    manifest_path = None
    if args.demo:
        shards = write_demo_shards(args.demo, bytes_per_shard=int(args.demo_size_mib * (1 << 20)))
        for s in shards:
            repo.add_file(s.name, s)
        archive = write_demo_release(args.demo / "release" / "strata-v0.1.0-demo.tar.gz")
        manifest = release_manifest(hub, archive)
        manifest_path = args.demo / "release" / "engine.json"
        manifest_path.write_text(json.dumps(manifest, indent=2))
    else:
        folder = args.dir or args.replica
        if args.replica:
            try:
                from .. import replica  # engine_manager/replica.py, absent from a tree without the planner
            except ImportError:
                print("hub: engine_manager.replica is not available in this tree", file=sys.stderr)
                return 2
            replica.write_replica(args.replica)
        if folder:
            files = sorted(q for q in Path(folder).iterdir() if q.is_file() and not q.name.startswith("."))
            shas = _cached_sha256(Path(folder), files)
            for q in files:
                repo.add_file(q.name, q, sha256=shas[q.name])
    for spec in args.fault:
        hub.add_fault(Fault.parse(spec))

    print(f"HF_ENDPOINT={hub.url}", flush=True)
    print(f"hub: serving {args.repo} at commit {repo.head} ({len(repo.files(repo.head))} files)", flush=True)
    if manifest_path:
        print(f"hub: demo engine manifest at {manifest_path} (dsv41 download --engine --engine-manifest …)",
              flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    hub.start()
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    hub.stop()
    return 0
