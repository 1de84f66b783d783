"""Capture real llama-server responses and log lines into this folder, for tests/test_llamacpp.py.

Run: ``.venv/bin/python tests/data/llamacpp/capture.py`` (needs the [llamacpp] extra). Every capture is written
beside this file; ``commands.json`` records the exact argv of each llama-server run, the binary's version and the
date. The API key used here is a throwaway (``KEY`` below). Nothing here is edited by hand: rerun the script to
refresh the captures after a llama.cpp upgrade, then rerun the tests.

Captures:
  health_loading.json / health_ok.json       GET /health while loading (503) and once ready (200)
  slots_idle.json / slots_busy*.json / slots_after.json   GET /slots around two concurrent streamed requests
  metrics_before.txt / metrics_busy.txt / metrics_after.txt   GET /metrics (Prometheus text)
  slots_401.json / metrics_401.json          the same without the key
  chat_stream.txt / chat.json                a streamed (raw SSE) and a plain chat completion
  utf8_400.json / anybytes_reply.json        ill-formed UTF-8 in a request (400); a random-bytes reply
  log_lv4.log / log_lv5_placement.log        start-up log at -lv 4, and the placement lines at -lv 5
  fail_*.log                                 logs of runs that fail: unknown buffer type, bad model file,
                                             port in use, unknown argument, KV type the model cannot take

The ``cuda_*`` files come from the CUDA build on an H200, written by ``benchmarks/llamacpp_gpu.sh`` (its commands
in ``cuda_capture_commands.txt``; ``cuda_lv4_half_cpu_lm_none.log`` is the adapter's own command from that run).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from engine_manager import llamacpp_bin  # noqa: E402
from engine_manager.sim.launch import free_port  # noqa: E402
from engine_manager.testing import tinymoe  # noqa: E402

KEY = "capture-key-0123456789abcdef"
HDR = {"Authorization": f"Bearer {KEY}"}
commands: dict[str, list[str]] = {}


def start(name: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    commands[name] = argv
    f = open(log, "wb")
    return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_to_exit(name: str, argv: list[str], env: dict[str, str], out: Path, timeout: float = 60) -> int:
    commands[name] = argv
    r = subprocess.run(argv, env=env, capture_output=True, timeout=timeout)
    out.write_bytes(r.stdout + r.stderr)
    return r.returncode


def save_json(name: str, status: int, body) -> None:
    (HERE / name).write_text(json.dumps({"status": status, "body": body}, indent=1) + "\n")


def body_of(r: httpx.Response):
    try:
        return r.json()
    except ValueError:
        return r.text


def wait_ready(port: int, p: subprocess.Popen, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if p.poll() is not None:
            raise RuntimeError(f"llama-server exited with {p.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise TimeoutError("not ready")


def main() -> int:
    binary = llamacpp_bin.find_llama_server()
    env = dict(os.environ)
    env.update(binary.env())
    server = str(binary.path)
    tmp = Path(tempfile.mkdtemp(prefix="lcb-capture-"))
    tiny = tinymoe.write_tinymoe(tmp / "tiny")
    medium = tinymoe.write_tinymoe(tmp / "medium", n_layer=8, n_embd=256, n_head=8, n_head_kv=4, head_dim=32,
                                   n_expert=16, n_ff_exp=256, seed=7)
    anybytes = tinymoe.write_tinymoe(tmp / "anybytes", printable_only=False)
    procs: list[subprocess.Popen] = []
    try:
        # 1. readiness while loading (the medium model takes long enough to see 503), then the metric endpoints
        port = free_port()
        argv = [server, "-m", str(medium), "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY,
                "--metrics", "-np", "2", "-c", "4096", "--no-kv-unified", "-ctk", "q8_0", "-ctv", "q8_0",
                "-ot", r"blk\.(0|1|2|3)\.ffn_.*_exps\.=CPU", "-lv", "4", "--no-webui"]
        p = start("metrics_run", argv, env, tmp / "metrics_run.log")
        procs.append(p)
        seen_503 = None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.002)
                continue
            if r.status_code == 503 and seen_503 is None:
                seen_503 = r
            if r.status_code == 200:
                save_json("health_ok.json", 200, body_of(r))
                break
        if seen_503 is not None:
            save_json("health_loading.json", seen_503.status_code, body_of(seen_503))
        else:
            print("note: the load was too quick to see a 503; health_loading.json not refreshed")
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as c:
            r = c.get("/slots")
            save_json("slots_401.json", r.status_code, body_of(r))
            r = c.get("/metrics")
            save_json("metrics_401.json", r.status_code, body_of(r))
            save_json("slots_idle.json", 200, c.get("/slots", headers=HDR).json())
            (HERE / "metrics_before.txt").write_text(c.get("/metrics", headers=HDR).text)
            # two concurrent streamed requests; read /slots and /metrics while they decode
            results: list[str] = []

            def stream(n: int, content: str) -> None:
                body = {"messages": [{"role": "user", "content": content}], "max_tokens": n, "stream": True,
                        "temperature": 0, "stream_options": {"include_usage": True}}
                with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=HDR,
                                  timeout=120) as resp:
                    results.append(resp.read().decode())

            ths = [threading.Thread(target=stream, args=(n, f"question number {i}"))
                   for i, n in enumerate((1500, 1000))]
            for th in ths:
                th.start()
            busy = []
            t0 = time.monotonic()
            while any(th.is_alive() for th in ths) and time.monotonic() - t0 < 120:
                s = c.get("/slots", headers=HDR).json()
                if sum(1 for x in s if x.get("is_processing")) == 2 and all(
                        x.get("next_token", [{}])[0].get("n_decoded", 0) > 0 for x in s):
                    busy.append((time.time(), s, c.get("/metrics", headers=HDR).text))
                    if len(busy) == 2:
                        break
                    time.sleep(0.25)
                else:
                    time.sleep(0.01)
            for th in ths:
                th.join(120)
            if len(busy) == 2:
                for i, (t, s, _m) in enumerate(busy, 1):
                    save_json(f"slots_busy{i}.json", 200, {"t": t, "slots": s})
                (HERE / "metrics_busy.txt").write_text(busy[0][2])
            else:
                print("warning: did not catch both slots decoding; slots_busy*.json not refreshed")
            save_json("slots_after.json", 200, c.get("/slots", headers=HDR).json())
            (HERE / "metrics_after.txt").write_text(c.get("/metrics", headers=HDR).text)
            (HERE / "chat_stream.txt").write_text(
                _stream_once(base, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
                                    "stream": True, "temperature": 0,
                                    "stream_options": {"include_usage": True}}))
            r = c.post("/v1/chat/completions", headers=HDR,
                       json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
                             "temperature": 0})
            save_json("chat.json", r.status_code, body_of(r))
        stop(p)
        log = (tmp / "metrics_run.log").read_text(errors="replace")
        (HERE / "log_lv4.log").write_text(log)

        # 2. placement detail at -lv 5: keep only the lines the parser reads (the rest is per-token noise)
        port = free_port()
        argv = [server, "-m", str(tiny), "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY,
                "-np", "1", "-c", "2048", "-ot", r"blk\.(0|2)\.ffn_.*_exps\.=CPU", "-lv", "5", "--no-webui"]
        p = start("placement_lv5", argv, env, tmp / "lv5.log")
        procs.append(p)
        wait_ready(port, p)
        stop(p)
        keep = re.compile(r"overridden|buffer size|assigned to device|dev = |offloaded|loading model tensors|"
                          r"llama_kv_cache: size|common_params_fit_impl|model loaded|listening on")
        lines = [ln for ln in (tmp / "lv5.log").read_text(errors="replace").splitlines() if keep.search(ln)]
        (HERE / "log_lv5_placement.log").write_text("\n".join(lines) + "\n")

        # 3. invalid UTF-8 is a request error (HTTP 400) and the server keeps running. This build answers a
        #    reply of random bytes with U+FFFD replacement characters (anybytes_reply.json); the 400 comes from
        #    a request body with ill-formed UTF-8 (e.g. a client echoing raw bytes of an earlier reply).
        port = free_port()
        argv = [server, "-m", str(anybytes), "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY,
                "-np", "1", "-c", "2048", "-lv", "4", "--no-webui"]
        p = start("utf8", argv, env, tmp / "utf8.log")
        procs.append(p)
        wait_ready(port, p)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        r = httpx.post(url, headers=HDR, timeout=60, json={"messages": [{"role": "user", "content": "bytes"}],
                                                            "max_tokens": 16, "temperature": 0})
        save_json("anybytes_reply.json", r.status_code, body_of(r))
        raw = b'{"messages":[{"role":"user","content":"hi \xc3\x28 there"}],"max_tokens":4}'
        r = httpx.post(url, headers={**HDR, "Content-Type": "application/json"}, content=raw, timeout=60)
        save_json("utf8_400.json", r.status_code, body_of(r))
        alive = p.poll() is None and httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        stop(p)
        (HERE / "utf8_server_alive.txt").write_text(f"{alive}\n")

        # 4. failures
        port = free_port()
        run_to_exit("fail_unknown_buffer", [server, "-m", str(tiny), "--host", "127.0.0.1", "--port", str(port),
                                            "-ot", r"blk\.0\.ffn_.*_exps\.=CUDA0", "--no-webui"],
                    env, HERE / "fail_unknown_buffer.log")
        bad = tmp / "bad-00001-of-00002.gguf"
        bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + os.urandom(64))
        run_to_exit("fail_bad_model", [server, "-m", str(bad), "--host", "127.0.0.1", "--port", str(port),
                                       "--no-webui"], env, HERE / "fail_bad_model.log")
        run_to_exit("fail_missing_model", [server, "-m", str(tmp / "nope.gguf"), "--host", "127.0.0.1",
                                           "--port", str(port), "--no-webui"], env, HERE / "fail_missing_model.log")
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen(1)
            taken = holder.getsockname()[1]
            run_to_exit("fail_port_in_use", [server, "-m", str(tiny), "--host", "127.0.0.1", "--port", str(taken),
                                             "--no-webui"], env, HERE / "fail_port_in_use.log")
        run_to_exit("fail_bad_arg", [server, "-m", str(tiny), "--no-such-flag", "1"], env, HERE / "fail_bad_arg.log")
        odd = tinymoe.write_tinymoe(tmp / "hd16", head_dim=16)
        run_to_exit("fail_kv_type", [server, "-m", str(odd), "--host", "127.0.0.1", "--port", str(port),
                                     "-ctk", "q8_0", "-ctv", "q8_0", "--no-webui"], env, HERE / "fail_kv_type.log")
    finally:
        for p in procs:
            stop(p)
    meta = {"captured": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "binary": str(binary.path), "version": llamacpp_bin.version(binary),
            "note": "paths under /tmp are the capture's temporary model folders",
            "commands": commands}
    (HERE / "commands.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"captured into {HERE}")
    return 0


def _stream_once(base: str, body: dict) -> str:
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=HDR, timeout=60) as r:
        return r.read().decode()


if __name__ == "__main__":
    sys.exit(main())
