"""Provisioning the Strata pack with the release's own tool, and shard 1 from split metadata.

Facts relied on (Niko1221/Strata):
- ``setup.py``'s native-pack branch runs ``python tools/iq_pack.py --gguf SHARD1 --out PACK``; ``tools/iq_pack.py``
  ``main()`` (commit 0902837) writes ``dense.bin`` and ``index.txt`` in place (not atomically), runs
  ``tools/strata_tokenizer.py`` for ``tokenizer/``, and publishes ``native_experts.txt`` last through
  ``native_experts.txt.tmp`` — the file Strata's setup gates on. So a killed run leaves files that merely exist.
- ``serve/server.py`` ``main()`` refuses ``--engine strata`` without ``<tokenizer>/vocab.json``.

The release used here is the stand-in in ``tests/strata_release`` (it refuses what Strata's tool refuses and has a
fault switch, ``STRATA_STANDIN_PACK_FAIL``, that kills it part-way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
from supervisor_helpers import drain

from engine_manager import provision
from engine_manager.engines import get_engine
from engine_manager.gguf_split import SplitError, find_split, first_shard
from engine_manager.settings import load_settings
from engine_manager.testing.tinymoe import write_tinymoe

STANDIN = Path(__file__).parent / "strata_release"


def make_release(dest: Path) -> Path:
    try:
        from tests.strata_support import make_strata_release   # H3a's full stand-in release, when present
    except ImportError:
        make_strata_release = None
    if make_strata_release is not None:
        make_strata_release(dest)
    else:
        shutil.copytree(STANDIN, dest)
    return dest


@pytest.fixture(scope="module")
def model_src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tinymoe")
    write_tinymoe(d, shards=2)
    return d


def model_copy(src: Path, dest: Path, stem: str = "not-the-real-name") -> Path:
    """The split under another name than the real model's shards (still <stem>-0000N-of-0000M.gguf, which
    Strata's tool needs to find the other shards beside shard 1)."""
    dest.mkdir(parents=True)
    for f in sorted(src.glob("*.gguf")):
        tail = re.search(r"-\d{5}-of-\d{5}\.gguf$", f.name).group(0)
        shutil.copyfile(f, dest / f"{stem}{tail}")
    return dest


# ------------------------------------------------------------------------------------------------ shard 1
def test_shard_one_comes_from_split_metadata_not_the_file_name(model_src, tmp_path):
    """Files renamed so that the name order is the opposite of the split order: shard 1 is the file whose
    split.no is 0. (The old lookup took the first *.gguf by name.)"""
    d = tmp_path / "renamed"
    d.mkdir()
    shards = sorted(model_src.glob("*.gguf"))
    shutil.copyfile(shards[0], d / "zz-part.gguf")       # split.no 0
    shutil.copyfile(shards[1], d / "aa-part.gguf")       # split.no 1
    split = find_split(d)
    assert split.first == d / "zz-part.gguf" and split.shards == (d / "zz-part.gguf", d / "aa-part.gguf")
    assert first_shard(d / "aa-part.gguf") == d / "zz-part.gguf"          # any shard names its folder
    s = load_settings(env={"DSV41_MODEL_DIR": str(d)}, path=tmp_path / "s.json").settings
    assert get_engine("strata").model_file(s, None) == str(d / "zz-part.gguf")
    (d / "zz-part.gguf").unlink()
    with pytest.raises(SplitError, match=r"Shard 1 \(split.no 0\).*missing"):
        find_split(d)


def test_a_missing_shard_is_named(model_src, tmp_path):
    d = model_copy(model_src, tmp_path / "m")
    next(d.glob("*-00002-of-*.gguf")).unlink()
    with pytest.raises(SplitError, match=r"Shard 2 of 2 \(split.no 1\).*missing"):
        find_split(d)


# ------------------------------------------------------------------------------------------------ provision
def test_provision_runs_the_release_tool_once_and_records_its_own_sentinel(model_src, tmp_path):
    release = make_release(tmp_path / "release")
    d = model_copy(model_src, tmp_path / "model")
    events, pack = drain(provision.provision(release, d))
    phases = [e.phase for e in events]
    assert phases[0] == "check" and "start" in phases and phases[-1] == "done"
    start = next(e for e in events if e.phase == "start")
    # the release's own tool, on the split's shard 1, as an argv list
    shard1 = d / "not-the-real-name-00001-of-00002.gguf"
    assert start.argv[1:] == [str(release / "tools" / "iq_pack.py"), "--gguf", str(shard1), "--out", start.argv[-1]]
    assert any(e.phase == "output" and e.text.startswith("index.txt:") for e in events)
    assert pack == provision.pack_dir_for(d / "not-the-real-name-00001-of-00002.gguf")
    assert pack.parent.name == "packs" and pack.name == "not-the-real-name"
    assert (pack / "tokenizer" / "vocab.json").is_file() and (pack / "native_experts.txt").is_file()
    sentinel = pack / provision.SENTINEL
    rec = json.loads(sentinel.read_text())
    assert stat.S_IMODE(sentinel.stat().st_mode) == 0o600 and rec["marker"] == provision.MARKER
    assert rec["files"]["index.txt"] == (pack / "index.txt").stat().st_size
    assert not list(pack.parent.glob(".*.partial"))
    # a second run does not run the tool again
    events2, pack2 = drain(provision.provision(release, d))
    assert pack2 == pack and [e.phase for e in events2] == ["done"] and events2[0].skipped


def test_a_pack_left_without_the_panels_sentinel_is_made_again(model_src, tmp_path):
    """What a killed Strata run leaves: files that exist (even the completion marker) but no record that the
    panel saw the tool finish. Strata's own gate (native_experts.txt exists) would take it as done."""
    release = make_release(tmp_path / "release")
    d = model_copy(model_src, tmp_path / "model")
    shard1 = d / "not-the-real-name-00001-of-00002.gguf"
    pack = provision.pack_dir_for(shard1)
    (pack / "tokenizer").mkdir(parents=True)
    (pack / "native_experts.txt").write_text("# half\n")
    (pack / "index.txt").write_text("")
    (pack / "tokenizer" / "vocab.json").write_text("{")
    ready, why = provision.pack_state(pack, find_split(d))
    assert not ready and "never saw it finish" in why
    events, _ = drain(provision.provision(release, d))
    assert any(e.phase == "start" for e in events)
    assert json.loads((pack / "tokenizer" / "vocab.json").read_text())      # made again, whole


def test_a_pack_whose_files_changed_is_made_again(model_src, tmp_path):
    release = make_release(tmp_path / "release")
    d = model_copy(model_src, tmp_path / "model")
    _, pack = drain(provision.provision(release, d))
    with open(pack / "index.txt", "a") as f:
        f.write("x\n")
    ready, why = provision.pack_state(pack, find_split(d))
    assert not ready and "index.txt" in why
    events, _ = drain(provision.provision(release, d))
    assert any(e.phase == "start" for e in events)
    assert provision.pack_state(pack, find_split(d))[0]


@pytest.mark.parametrize("where", ["after-dense", "after-index"])
def test_a_killed_step_fails_in_plain_words_and_is_redone(model_src, tmp_path, monkeypatch, where):
    release = make_release(tmp_path / "release")
    d = model_copy(model_src, tmp_path / "model")
    monkeypatch.setenv("STRATA_STANDIN_PACK_FAIL", where)
    with pytest.raises(provision.ProvisionError) as ei:
        drain(provision.provision(release, d))
    msg = str(ei.value)
    assert "iq_pack.py stopped with exit code 1" in msg and f"STRATA_STANDIN_PACK_FAIL={where}" in msg
    assert "dsv41 prepare" in msg
    shard1 = d / "not-the-real-name-00001-of-00002.gguf"
    pack = provision.pack_dir_for(shard1)
    assert not provision.pack_state(pack, find_split(d))[0]
    monkeypatch.delenv("STRATA_STANDIN_PACK_FAIL")
    events, _ = drain(provision.provision(release, d))
    assert any(e.phase == "start" for e in events) and provision.pack_state(pack, find_split(d))[0]


def test_a_release_without_the_tool_is_said_plainly(model_src, tmp_path):
    release = tmp_path / "release"
    release.mkdir()
    d = model_copy(model_src, tmp_path / "model")
    with pytest.raises(provision.ProvisionError, match=r"has no tools/iq_pack.py.*DSV41_ENGINE_DIR"):
        drain(provision.provision(release, d))


def test_progress_from_the_tools_counts():
    assert provision.parse_progress("  layer  8  IQ2_XS  /Q2_K    blob  123  at 1.00 GiB", 43) == (9, 43)
    assert provision.parse_progress("wrote 3/7 shards", None) == (3, 7)
    assert provision.parse_progress("index.txt: 10 tensors, 3 served natively", None) is None


def test_closing_the_generator_kills_the_tool(model_src, tmp_path):
    """A cancel (GUI) or Ctrl+C closes the generator: the tool must not keep writing."""
    release = make_release(tmp_path / "release")
    slow = release / "tools" / "iq_pack.py"
    slow.write_text("import sys, time\nprint('model shards: x', flush=True)\ntime.sleep(600)\n")
    d = model_copy(model_src, tmp_path / "model")
    gen = provision.provision(release, d)
    pid = None
    for ev in gen:
        if ev.phase == "start":
            pid = ev.pid
        if ev.phase == "output":
            break
    gen.close()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_preflight_names_each_missing_piece_in_plain_words(model_src, tmp_path):
    """Release missing; binary missing; the pack not prepared (and, without the release's tool, not preparable);
    the model missing — each said in words that name what to do."""
    eng = get_engine("strata")
    d = model_copy(model_src, tmp_path / "model")

    def problems(release: Path, model_dir: Path) -> str:
        s = load_settings(env={"DSV41_ENGINE_DIR": str(release), "DSV41_MODEL_DIR": str(model_dir)},
                          path=tmp_path / "s.json").settings
        return " ".join(eng.preflight(eng.build_launch(s, None, tmp_path / "run")))

    assert "release is not installed" in problems(tmp_path / "nowhere", d)
    release = make_release(tmp_path / "release")
    text = problems(release, d)
    assert "not prepared for the Strata engine" in text and "`dsv41 prepare`" in text
    drain(eng.prepare(load_settings(env={"DSV41_ENGINE_DIR": str(release), "DSV41_MODEL_DIR": str(d)},
                                    path=tmp_path / "s.json").settings, None))
    assert problems(release, d) == ""
    (release / "engine" / "strata").unlink()
    assert "engine binary" in problems(release, d)
    shutil.rmtree(release / "tools")
    with open(provision.pack_dir_for(find_split(d).first) / "index.txt", "a") as f:
        f.write("changed\n")
    assert "cannot be: the release has no tools/iq_pack.py" in problems(release, d)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "No model file" in problems(release, empty)


def test_two_provisionings_of_one_pack_do_not_run_at_once(model_src, tmp_path):
    """The GUI's Prepare, `dsv41 prepare` and a start share one staging folder: the second is refused in words
    while the first holds the pack's lock."""
    import fcntl

    release = make_release(tmp_path / "release")
    d = model_copy(model_src, tmp_path / "model")
    pack = provision.pack_dir_for(find_split(d).first)
    pack.parent.mkdir(parents=True, exist_ok=True)
    with open(pack.parent / f".{pack.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(provision.ProvisionError, match="Another dsv41 .* is preparing"):
            drain(provision.provision(release, d))
    events, _ = drain(provision.provision(release, d))
    assert events[-1].phase == "done"
