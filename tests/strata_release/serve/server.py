"""serve/server.py - STAND-IN (dsv41 panel test fixture) for Strata's HTTP server. Standard library only, no Strata
code.

    python serve/server.py --engine mock --port 8095                                  (the default engine: a greeting)
    python serve/server.py --engine strata --config strata.json --host 127.0.0.1 --port 8090 [--gpu 0]

It behaves - and refuses - like Niko1221/Strata serve/server.py @2291cb3 where the dsv41 panel meets it. Each fact
below was read in that file (function named); the wording of messages is Strata's where quoted.

main():
- `--engine` choices mock|strata, DEFAULT mock: the mock engine answers every chat with its script ("Thinking about
  it.</think>\\n\\nHello from the mock engine.") while /health says loaded;
- `--api-key` defaults to $STRATA_API_KEY; an empty one (the variable set to blanks, or `--api-key ""`) prints
  "[strata] an API key was given but it is empty: set a key, or leave --api-key / STRATA_API_KEY out" and exits 2 -
  after the engine started, as in Strata; a comma-separated list is several keys (key_list);
- the config (JSON, a BOM allowed): `tokenizer` overrides --tokenizer; with --engine strata a tokenizer directory
  without vocab.json is `ap.error("the model's tokenizer is missing (<dir>/vocab.json); run setup again")` (exit 2);
  `--engine strata` without --config: `ap.error("--engine strata needs --config")`; `exe` relative to `cwd`;
  `model_name` is what /v1/models says (default "qwen3.8-flash-next"); `--gpu` overrides the config's `gpu`; `host`
  from --host, else the config, else 127.0.0.1; the port is checked free BEFORE the engine starts, and opened after;
- SIGTERM takes the Ctrl+C path: the engine gets QUIT (then terminate, then kill, 20 s each: StrataEngine.close, and
  EngineStuck's "did not end after QUIT, terminate and kill"), the server ends with "[strata] stopped", exit 0; a
  SECOND SIGTERM (or Ctrl+C) while it closes is another KeyboardInterrupt, and the engine is killed at once;
- the server needs its release's .venv (serve/frontend.py imports jinja2 at module level): see the import below.
StrataEngine: `[exe, "--serve", *engine_args(cfg)]`, cwd=cfg["cwd"], stdin/stdout pipes, stderr appended to the
  config's `log` (DEVNULL without one), after a "[strata] <time> engine started: <exe> --serve <args>" line; waits for
  READY (STRATA_ENGINE_READY_S, 900 s), keeps `INFO k=v` (numbers as int); an engine that ends first raises
  EngineDied("the engine exited before it was ready (see LOG)" + the log's last 20 lines) - uncaught in main(), so
  the server exits 1 with that traceback; `_parse_done` reads the DONE fields; a dead engine is started again by the
  next request ("the engine stopped unexpectedly (exit code N)" ends the request that saw it die).
engine_args / child_env (kido5217/Vsrata docs/research/runtime-contract.md §2.2 maps them to server.py lines):
  `parallel` N >= 2 appends `--batch N`; the child's environment is the server's, plus CUDA_DEVICE_ORDER=PCI_BUS_ID
  and CUDA_VISIBLE_DEVICES from `gpu`, plus the config's `env`, with existing `lib_dirs` PREPENDED to LD_LIBRARY_PATH.
HTTP (make_handler): HTTP/1.0, "Connection: close"; `_authorized`: "Authorization: Bearer KEY" or "x-api-key",
  constant-time (key_matches), else 401 {"error": {"type": "authentication_error", "message": "missing or wrong API
  key"}}; /health and /api/health are open (status, max_context, model, images, api_key, loaded, service "strata");
  /v1/models, /models, /props, /slots, /status, /v1/status, /metrics (JSON; Prometheus text with Accept: text/plain
  or ?format=prometheus, vLLM names + strata:*, serve/prometheus.py @6c0f3ce), /metrics/prometheus (llamacpp:*) need
  the key; 404 {"error": {"message": "not found"}}.
POST /v1/chat/completions (openai_chunks, _openai): SSE `data:` frames, the first with {"role": "assistant",
  "content": ""}, `delta.reasoning_content` for the thinking, `delta.content` for the answer, ": keep-alive" comments
  (a PP line, or 10 s of waiting), a last chunk with finish_reason and ALWAYS `usage` (prompt_tokens_details.
  cached_tokens) and `timings` (request_timings, llama.cpp's names); then "data: [DONE]". An engine that dies
  mid-stream: `data: {"error": {"type": "server_error", "message": "<why>; the next request restarts it"}}` then
  `data: [DONE]`; before the answer started: 503 with the same error. Requests wait their turn in a FIFO (never 409).
Service.metrics / v1_status / slots: the shapes of tests/data/strata (H1's cited fixtures): live.tok_s null unless
  generating, finished requests in `requests` (hit_rate = hits / lookups to 3 decimals), `engine` = the INFO facts.

Stand-in liberties: no Anthropic/Responses routes, no tools, no images, no batch slots; the chat template is not
rendered with Jinja - a DeepSeek-style prompt (when the pack's template speaks <｜User｜>) or ChatML is built by hand;
telemetry is RAM only (no NVML: `machine.gpu` is null, as on a machine without one).
"""
from __future__ import annotations

import argparse
import collections
import errno
import hmac
import ipaddress
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

# serve/frontend.py (imported first by Strata's server.py @2291cb3) imports jinja2 at module level: Strata's server
# runs only under the release's .venv, where setup.py @28c47b1 pip_install put it. The stand-in imports a module of
# that NAME the same way (a stub that exists only in the stand-in release's .venv: tests/strata_release/
# venv-site-packages/jinja2), so under the panel's own interpreter it fails as Strata's does: No module named 'jinja2'.
import jinja2  # noqa: F401,E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import strata_tokenizer as ST  # noqa: E402

IM_END = "<|im_end|>"
THINK_END = "</think>"
CTX_SLACK = 8
RATE_WINDOW_S = 2.0
QUEUE_BEAT_S = 10.0
MOCK_SCRIPT = "Thinking about it.</think>\n\nHello from the mock engine."


def _timeout_env(name: str, default: float):
    try:
        v = float(os.environ.get(name, default))
    except ValueError:
        v = default
    return None if v <= 0 else v


ENGINE_READY_S = _timeout_env("STRATA_ENGINE_READY_S", 900.0)


# ------------------------------------------------------------------------------------------------ tokenizers
class ByteTokenizer:
    """No tokenizer directory: one id per byte, <|im_end|> = 257, <|endoftext|> = 258 (serve/fake_mask_engine.py's
    description of Strata's ByteTokenizer)."""
    SPECIAL = {IM_END: 257, "<|endoftext|>": 258}

    def __init__(self):
        self.tokens = [bytes([i]).decode("latin-1") for i in range(256)] + ["", IM_END, "<|endoftext|>"]

    def encode(self, text: str, parse_special: bool = True) -> list:
        out, i = [], 0
        while i < len(text):
            hit = next((s for s in self.SPECIAL if parse_special and text.startswith(s, i)), None)
            if hit:
                out.append(self.SPECIAL[hit])
                i += len(hit)
            else:
                out += list(text[i].encode("utf-8"))
                i += 1
        return out

    def piece_bytes(self, tid: int) -> bytes:
        return bytes([tid]) if tid < 256 else self.tokens[tid].encode()

    def is_special(self, tid: int) -> bool:
        return tid in (257, 258)


# ------------------------------------------------------------------------------------------------ engines
class EngineDied(RuntimeError):
    """The engine process ended (before READY, or in the middle of a request)."""


class MockEngine:
    def __init__(self, tok, script: str, max_context: int = 32768):
        self.tok, self.max_context = tok, max_context
        end = [t for t in tok.encode(IM_END, parse_special=True) if tok.is_special(t)]
        self.script = tok.encode(script, parse_special=True) + end[:1]
        self.info = {}

    def alive(self) -> bool:
        return True

    def generate(self, ids, max_new, sampling, cancel):
        for t in self.script[:max_new]:
            if cancel.is_set():
                return
            yield t

    def close(self):
        pass


def start_log_tail(log, offset: int, n: int = 20) -> str:
    if not log:
        return ""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [x.rstrip() for x in text.splitlines() if x.strip()][-n:]
    return ("\nthe engine log's last lines:\n" + "\n".join("  " + x for x in lines)) if lines else ""


class StrataEngine:
    def __init__(self, exe: str, args: list, cwd=None, log=None, env=None, lazy: bool = False):
        self.spawn = (exe, list(args), cwd, log, env)
        self.args = list(args)
        self.log_path = log
        self.proc = None
        self.info = {}
        self.last = {}
        self.progress = None
        self.prefill_tok_s_mean = None
        self.unloaded = lazy
        self.max_context = int(args[args.index("--max-context") + 1]) if "--max-context" in args else 4096
        paths = {k: v for k, v in zip(args, args[1:]) if k in ("--native", "--pack")}
        self.model_path = paths.get("--native") or paths.get("--pack", "pack/full")
        try:
            self.info["version"] = json.loads((Path(exe).parent / "BUILD.json").read_text()).get("version")
        except (OSError, ValueError):
            self.info["version"] = None
        if not lazy:
            self._start()

    def _start(self):
        exe, args, cwd, log, env = self.spawn
        self.unloaded = False
        logf = open(log, "a", encoding="utf-8") if log else subprocess.DEVNULL
        log_start = os.path.getsize(log) if log else 0
        if log:
            logf.write(f"[strata] {time.strftime('%Y-%m-%d %H:%M:%S')} engine started: {exe} --serve "
                       f"{' '.join(args)}\n")
            logf.flush()
        self.max_context = 0
        self.proc = subprocess.Popen([exe, "--serve", *args], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=logf, text=True, encoding="utf-8", bufsize=1, env=env)
        if log:
            logf.close()                                # the child holds its own handle
        ready: queue.Queue = queue.Queue()

        def first_lines(proc=self.proc):
            try:
                for line in proc.stdout:
                    ready.put(line)
                    if line.startswith("READY"):
                        return
            except (OSError, ValueError):
                pass
            ready.put(None)

        threading.Thread(target=first_lines, daemon=True).start()
        deadline = None if ENGINE_READY_S is None else time.monotonic() + ENGINE_READY_S
        timed_out = False
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                timed_out = True
                break
            try:
                line = ready.get(timeout=left)
            except queue.Empty:
                timed_out = True
                break
            if line is None:
                break
            if line.startswith("INFO "):
                for kv in line.split()[1:]:
                    k, _, v = kv.partition("=")
                    self.info[k] = int(v) if v.lstrip("-").isdigit() else v
            if line.startswith("READY"):
                self.max_context = int(line.split()[1])
                break
        if self.max_context <= 0:
            if timed_out:
                self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            why = (f"the engine did not report READY within {ENGINE_READY_S:.0f} s" if timed_out else
                   "the engine exited before it was ready")
            raise EngineDied(why + (f" (see {log})" if log else "") + start_log_tail(log, log_start))
        if self.info.get("engine"):
            self.info["version"] = str(self.info["engine"])
        self.batch = int(self.info.get("batch_slots") or 0)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self.lines), daemon=True).start()

    @staticmethod
    def _pump(proc, lines):
        try:
            for line in proc.stdout:
                lines.put(line)
        except (OSError, ValueError):
            pass
        lines.put(None)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.max_context > 0

    def exit_code(self):
        try:
            return self.proc.wait(timeout=5) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            return None

    def restart(self):
        self.close()
        self._start()

    def _send(self, text: str):
        try:
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError, AttributeError):
            raise EngineDied(f"the engine stopped unexpectedly (exit code {self.exit_code()})") from None

    def _parse_done(self, line: str):
        f = line.split()
        last = {"generated": int(f[1]), "prompt_tokens": int(f[2]), "prompt_ms": float(f[3]),
                "decode_ms": float(f[4]), "finish": f[5]}
        if len(f) >= 9:
            last.update(drafts_accepted=int(f[6]), drafts_offered=int(f[7]), reused=int(f[8]))
        if len(f) >= 11:
            last.update(hits=int(f[9]), lookups=int(f[10]))
        if len(f) >= 14:
            last.update(ram_blobs=int(f[11]), file_blobs=int(f[12]), file_mb=float(f[13]))
        if len(f) >= 15:
            last.update(prompt_read=int(f[14]))
        if len(f) >= 16:
            last.update(offloaded=int(f[15]))
        self.last = last

    @staticmethod
    def sampling_keys(sampling: dict) -> str:
        keys = ""
        t = sampling.get("temperature")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and float(t) > 0.0:
            keys += f" temperature={float(t)!r}"
        tp = sampling.get("top_p")
        if isinstance(tp, (int, float)) and not isinstance(tp, bool) and float(tp) < 1.0:
            keys += f" top_p={float(tp)!r}"
        seed = sampling.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool) and seed > 0:
            keys += f" seed={seed}"
        return keys

    def generate(self, ids, max_new, sampling, cancel):
        """Token ids; None as a heartbeat (a PP line, or 10 s of quiet). STOP on cancel, read to DONE always."""
        if not self.alive():
            raise EngineDied("the engine is unavailable; this request was not sent")
        self.progress, self.prefill_tok_s_mean = None, None
        self._send(f"GEN {int(max_new)}{self.sampling_keys(sampling or {})} {','.join(str(int(t)) for t in ids)}")
        done, stopped, beat = False, False, time.monotonic()
        try:
            while True:
                try:
                    line = self.lines.get(timeout=0.5)
                except queue.Empty:
                    if cancel.is_set() and not stopped:
                        self._send("STOP")
                        stopped = True
                    if time.monotonic() - beat >= 10.0:
                        beat = time.monotonic()
                        yield None
                    continue
                beat = time.monotonic()
                if line is None:
                    done = True
                    raise EngineDied(f"the engine stopped unexpectedly (exit code {self.exit_code()})")
                if line.startswith("T "):
                    if cancel.is_set() and not stopped:
                        self._send("STOP")
                        stopped = True
                    yield int(line[2:])
                elif line.startswith("PP "):
                    f = line.split()
                    if len(f) >= 3 and f[1].isdigit() and f[2].isdigit():
                        self.progress = (int(f[1]), int(f[2]))
                        self.prefill_tok_s_mean = float(f[4]) if len(f) >= 5 else None
                    yield None
                elif line.startswith("DONE"):
                    self._parse_done(line)
                    done = True
                    return
                elif line.startswith("ERR"):
                    done = True                       # the engine refused it and is idle: no DONE follows
                    raise ValueError(line[4:].strip())
        finally:
            if not done and self.alive():             # the consumer left early: keep the engine in step
                try:
                    if not stopped:
                        self._send("STOP")
                    end = time.monotonic() + 30
                    while time.monotonic() < end:
                        try:
                            line = self.lines.get(timeout=1.0)
                        except queue.Empty:
                            continue
                        if line is None or line.startswith(("DONE", "ERR")):
                            if line and line.startswith("DONE"):
                                self._parse_done(line)
                            break
                except EngineDied:
                    pass

    def close(self):
        proc = self.proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.stdin.write("QUIT\n")
                proc.stdin.flush()
        except (OSError, ValueError):
            pass
        try:                                            # QUIT, then terminate, then kill: 20 s each
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except (OSError, ValueError):
                pass
        self.proc = None
        self.max_context = 0


# ------------------------------------------------------------------------------------------------ config
def gpu_list(cfg: dict) -> list:
    g = cfg.get("gpu")
    if g is None or g == "":
        return []
    if isinstance(g, int):
        return [g]
    if isinstance(g, list):
        return [int(x) for x in g]
    return [int(x) for x in str(g).split(",") if x.strip()]


def engine_args(cfg: dict) -> list:
    args = [str(a) for a in (cfg.get("args") or [])]
    p = cfg.get("parallel")
    if isinstance(p, int) and not isinstance(p, bool) and p >= 2 and "--batch" not in args and "--slots" not in args:
        args += ["--batch", str(p)]
    return args


def child_env(cfg: dict) -> dict:
    env = dict(os.environ)
    gpus = gpu_list(cfg)
    if gpus:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    for k, v in (cfg.get("env") or {}).items():
        env[str(k)] = str(v)
    dirs = [str(d) for d in (cfg.get("lib_dirs") or []) if os.path.isdir(str(d))]
    if dirs:
        old = env.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + ([old] if old else []))
    return env


def key_list(value) -> list:
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        return [str(k) for k in value if str(k)]
    return [k.strip() for k in str(value).split(",") if k.strip()]


def key_matches(given: str, key) -> bool:
    raw = given.encode("latin-1", "replace")
    ok = False
    for k in key_list(key):
        ok |= hmac.compare_digest(raw, k.encode())
    return ok


def host_allowed(host) -> bool:
    if not (host or "").strip():
        return True
    name = host.rsplit(":", 1)[0].strip("[]") if not host.startswith("[") else host[1:host.find("]")]
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name == "localhost" or name.endswith(".localhost")


# ------------------------------------------------------------------------------------------------ the service
class FifoLock:
    """Requests take their turn in arrival order."""

    def __init__(self):
        self.cv = threading.Condition()
        self.next_ticket = 0
        self.serving = 0

    def take(self) -> int:
        with self.cv:
            t = self.next_ticket
            self.next_ticket += 1
            return t

    def wait_turn(self, ticket: int, timeout: float) -> bool:
        with self.cv:
            if self.serving != ticket:
                self.cv.wait(timeout)
            return self.serving == ticket

    def release(self):
        with self.cv:
            self.serving += 1
            self.cv.notify_all()


class Service:
    def __init__(self, engine, tok, model: str, template_text: str):
        self.engine, self.tok, self.model = engine, tok, model
        self.template_text = template_text or ""
        self.api_key = ""
        self.fifo = FifoLock()
        self.status_lock = threading.Lock()
        self.status = {"busy": False, "queued": 0}
        self.history: collections.deque = collections.deque(maxlen=500)
        self.started_at = time.time()
        self.totals = {"since": self.started_at, "requests": 0, "prompt_tokens": 0, "reused": 0, "output_tokens": 0,
                       "prompt_ms": 0.0, "decode_ms": 0.0, "drafts_offered": 0, "drafts_accepted": 0}
        self.rate: collections.deque = collections.deque(maxlen=4096)
        self.last_timings = None
        self.last_request_at = None
        self.stop_ids = ({t for t in range(len(tok.tokens)) if tok.is_special(t)} if hasattr(tok, "types")
                         else {257, 258})

    # ---- state
    def loaded(self) -> bool:
        return self.engine.alive()

    def reported_ctx(self) -> int:
        return int(self.engine.max_context or 0)

    def _tok_s(self) -> float:
        with self.status_lock:
            s, rate = dict(self.status), list(self.rate)
        if not s.get("busy") or not s.get("first_token"):
            return 0.0
        now = time.time()
        newest = rate[-1] if rate else None
        oldest = next(((t, g) for t, g in rate if now - t <= RATE_WINDOW_S), None)
        if newest and oldest and newest[0] - oldest[0] >= 0.25:
            return max(0.0, (newest[1] - oldest[1]) / (newest[0] - oldest[0]))
        return s["generated"] / max(0.25, now - s["first_token"])

    def _tok_s_mean(self) -> float:
        with self.status_lock:
            s = dict(self.status)
        if not s.get("busy") or not s.get("first_token"):
            return 0.0
        return s["generated"] / max(1e-6, time.time() - s["first_token"])

    # ---- a request
    def render(self, messages: list, thinking: bool) -> str:
        def text(c):
            if isinstance(c, list):
                return "".join(p.get("text", "") for p in c if isinstance(p, dict))
            return str(c or "")
        if "<｜User｜>" in self.template_text:
            bos_tok = "<｜begin▁of▁sentence｜>"
            bos = bos_tok if getattr(self.tok, "ids", {}).get(bos_tok) is not None else ""
            out = bos
            for m in messages:
                role = m.get("role")
                if role == "system":
                    out += text(m.get("content"))
                elif role == "user":
                    out += "<｜User｜>" + text(m.get("content"))
                elif role == "assistant":
                    out += "<｜Assistant｜>" + text(m.get("content")) + "<｜end▁of▁sentence｜>"
            return out + "<｜Assistant｜>" + ("<think>\n" if thinking else "</think>")
        out = "".join(f"<|im_start|>{m.get('role')}\n{text(m.get('content'))}<|im_end|>\n" for m in messages)
        return out + "<|im_start|>assistant\n" + ("<think>\n" if thinking else "")

    def prepare(self, req: dict):
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: a non-empty list of messages")
        ctk = req.get("chat_template_kwargs") if isinstance(req.get("chat_template_kwargs"), dict) else {}
        thinking = ctk.get("enable_thinking", True) is not False
        ids = self.tok.encode(self.render(messages, thinking), parse_special=True)
        ctx = self.reported_ctx() or int(getattr(self.engine, "known_ctx", 0) or 0)
        if ctx <= 0 and not self.loaded():
            ctx = int(self.engine.max_context or 0)
        max_new = int(req.get("max_completion_tokens") or req.get("max_tokens") or 0)
        if ctx > 0:
            room = ctx - CTX_SLACK - len(ids)
            if max_new <= 0:
                if room < 1:
                    raise ValueError(f"prompt ({len(ids)} tokens) leaves no room to answer in the context ({ctx}); "
                                     "requests are never truncated")
                max_new = room
            elif max_new > room:
                raise ValueError(f"prompt ({len(ids)} tokens) + max tokens ({max_new}) exceeds the context ({ctx}); "
                                 f"requests are never truncated. Send a smaller max_tokens (at most {max(0, room)} "
                                 "here)")
        elif max_new <= 0:
            max_new = 4096
        return ids, thinking, max_new

    def ensure_loaded(self):
        eng = self.engine
        if eng.alive() or not hasattr(eng, "restart"):
            return
        if eng.proc is not None:
            print(f"[strata] the engine had stopped (exit code {eng.exit_code()}); starting it again (a minute or "
                  "two) ...", flush=True)
        eng.restart()

    def run(self, ids, thinking, max_new, sampling, cancel):
        """("ping", None) while waiting or reading, ("event", (kind, text)), then ("done", {...})."""
        stop_ids = self.stop_ids
        det = ST.Detokenizer(self.tok) if hasattr(self.tok, "types") else None
        parser = ThinkParser(thinking)
        n, finish, timings, before = 0, "length", None, None
        ticket = self.fifo.take()
        with self.status_lock:
            self.status["queued"] += 1
        beat = time.monotonic()
        try:
            while not self.fifo.wait_turn(ticket, 0.5):
                if cancel.is_set():
                    break
                if time.monotonic() - beat >= QUEUE_BEAT_S:
                    beat = time.monotonic()
                    yield "ping", None
        except GeneratorExit:
            # the client left while waiting: take the turn when it comes and hand it on at once
            threading.Thread(target=self._pass_turn, args=(ticket,), daemon=True).start()
            raise
        finally:
            with self.status_lock:
                self.status["queued"] -= 1
        if cancel.is_set():
            threading.Thread(target=self._pass_turn, args=(ticket,), daemon=True).start()
            return
        try:
            self.ensure_loaded()
            with self.status_lock:
                self.status.update(busy=True, phase="reading the prompt", prompt_tokens=len(ids), generated=0,
                                   started=time.time(), first_token=None, max_tokens=max_new)
                self.last_request_at = time.time()
                self.rate.clear()
            before = getattr(self.engine, "last", None)
            gen = self.engine.generate(ids, max_new, sampling, cancel)
            try:
                for t in gen:
                    if t is None:
                        yield "ping", None
                        continue
                    n += 1
                    if t in stop_ids:
                        finish = "stop"
                        break
                    piece = det.push(t) if det else self.tok.piece_bytes(t).decode("utf-8", "replace")
                    evs = parser.feed(piece)
                    with self.status_lock:
                        s = self.status
                        s["generated"] = n
                        if s.get("first_token") is None:
                            s["first_token"] = time.time()
                        self.rate.append((time.time(), n))
                        for kind, _ in evs:
                            s["phase"] = "thinking" if kind == "reasoning" else "answering"
                    for ev in evs:
                        yield "event", ev
            except EngineDied:
                finish = "error"
                raise
            finally:
                gen.close()
            if cancel.is_set():
                finish = "cancel"
        finally:
            with self.status_lock:
                if self.status.get("busy"):
                    last = getattr(self.engine, "last", None) or {}
                    fresh = last is not before and bool(last)
                    last = last if fresh else {}
                    hit_rate = round(last["hits"] / last["lookups"], 3) if last.get("lookups") else None
                    pcie = (round(last["offloaded"] / (last["lookups"] + last["offloaded"]), 3)
                            if last.get("offloaded") is not None and (last.get("lookups") or last["offloaded"])
                            else None)
                    started = self.status.get("started", time.time())
                    self.history.append({
                        "projection": None, "time": started, "duration_s": round(time.time() - started, 1),
                        "finish": finish, "prompt_tokens": len(ids), "reused": last.get("reused"),
                        "output_tokens": n, "prompt_total": len(ids), "prompt_read": last.get("prompt_read"),
                        "reasoning_recoveries": 0, "reasoning_repeat_coverage": 0.0,
                        "engine_generated": last.get("generated"), "prompt_ms": last.get("prompt_ms"),
                        "decode_ms": last.get("decode_ms"),
                        "decode_tok_s": round(last["generated"] / (last["decode_ms"] / 1000), 1)
                        if n and last.get("generated") and last.get("decode_ms") else None,
                        "hit_rate": hit_rate, "pcie_share": pcie, "ram_blobs": last.get("ram_blobs"),
                        "file_blobs": last.get("file_blobs"), "file_mb": last.get("file_mb"),
                        "drafts_offered": last.get("drafts_offered"), "drafts_accepted": last.get("drafts_accepted")})
                    t = self.totals
                    t["requests"] += 1
                    t["prompt_tokens"] += len(ids)
                    t["reused"] += last.get("reused") or 0
                    t["output_tokens"] += n
                    t["prompt_ms"] += last.get("prompt_ms") or 0.0
                    t["decode_ms"] += last.get("decode_ms") or 0.0
                    t["drafts_offered"] += last.get("drafts_offered") or 0
                    t["drafts_accepted"] += last.get("drafts_accepted") or 0
                    if fresh:
                        timings = request_timings(len(ids), n, last)
                        self.last_timings = dict(timings, at=int(time.time())) if timings else None
                    self.last_request_at = time.time()
                    now, ft = time.time(), self.status.get("first_token")
                    rate = n / max(1e-6, now - ft) if ft else 0.0
                    hit = f", expert cache {hit_rate * 100:.1f}% hit" if hit_rate is not None else ""
                    print(f"[strata] done: {n} tokens in {now - started:.0f} s ({rate:.1f} tok/s) "
                          f"({finish}, cancel={cancel.is_set()}){hit}", flush=True)
                self.status["busy"] = False
            self.fifo.release()
        for ev in parser.finish():
            yield "event", ev
        yield "done", {"finish": finish, "completion_tokens": n, "reused": (timings or {}).get("cache_n", 0),
                       "timings": timings}

    def _pass_turn(self, ticket):
        while not self.fifo.wait_turn(ticket, 1.0):
            pass
        self.fifo.release()

    # ---- views
    def metrics(self, all_requests: bool = False) -> dict:
        with self.status_lock:
            s, hist, totals = dict(self.status), list(self.history), dict(self.totals)
        now = time.time()
        progress = getattr(self.engine, "progress", None)
        if s.get("busy") and s.get("first_token") is None:
            state = "reading"
        elif s.get("busy"):
            state = "generating"
        elif not self.loaded():
            state = "unloaded"
        else:
            state = "idle"
        busy = bool(s.get("busy"))
        live = {"state": state, "queued": s.get("queued", 0), "phase": s.get("phase") if busy else None,
                "prompt_tokens": s.get("prompt_tokens") if busy else None, "prompt_read": None, "prompt_total": None,
                "generated": s.get("generated") if busy else None, "max_tokens": s.get("max_tokens") if busy else None,
                "elapsed_s": round(now - s["started"], 1) if busy and s.get("started") else None,
                "tok_s": round(self._tok_s(), 1) if state == "generating" else None,
                "tok_s_mean": round(self._tok_s_mean(), 1) if state == "generating" else None,
                "prefill_tok_s_mean": getattr(self.engine, "prefill_tok_s_mean", None) if busy else None,
                "tok_s_window_s": RATE_WINDOW_S if state == "generating" else None}
        if state == "reading" and progress:
            live["prompt_read"], live["prompt_total"] = progress
        engine = {"model": self.model, "max_context": self.reported_ctx(), "images": False,
                  **dict(getattr(self.engine, "info", {}) or {})}
        hw = {**telemetry(), "tok_s": round(self._tok_s(), 1), "tok_s_mean": round(self._tok_s_mean(), 1),
              "prefill_tok_s_mean": (getattr(self.engine, "prefill_tok_s_mean", None) or 0.0) if busy else 0.0}
        conv = {"enabled": False, "budget_mib": None, "slots": None, "parked": 0, "bytes": 0, "evictions": 0,
                "parks": 0, "restores": 0, "last_event": None, "last_tokens": None, "last_at": None,
                "requests": len(hist), "requests_reused": sum(1 for r in hist if (r.get("reused") or 0) > 0),
                "reused_tokens": totals.get("reused", 0), "prompt_tokens": totals.get("prompt_tokens", 0),
                "last_reused": hist[-1].get("reused") if hist else None,
                "last_prompt": hist[-1].get("prompt_tokens") if hist else None}
        return {"engine": engine, "live": live, "requests": hist[::-1][:None if all_requests else 12],
                "conversation_cache": conv, "requests_kept": len(hist), "totals": totals,
                "resources": {"enabled": False, "available": False, "memory": {"enabled": False}}, "hardware": hw,
                "hardware_static": {"gpu_name": None, "gpu_count": 0, "cpu_name": None, "cores": os.cpu_count(),
                                    "threads": os.cpu_count(), "psutil": False},
                "history": {}, "time": now}

    def v1_status(self) -> dict:
        with self.status_lock:
            s, totals = dict(self.status), dict(self.totals)
            last_t, last_at = (dict(self.last_timings) if self.last_timings else None), self.last_request_at
        hw = telemetry()
        busy, ctx = bool(s.get("busy")), self.reported_ctx()
        slots = max(1, int(getattr(self.engine, "batch", 0) or 0))
        return {
            "service": "strata", "model": self.model, "memory_policy": {"enabled": False},
            "resources": {"enabled": False, "available": False, "memory": {"enabled": False}}, "loaded": self.loaded(),
            "auto_load": hasattr(self.engine, "restart"),
            "structured_output": {"formats": ["json_object", "json_schema"], "method": "prompt_and_validate",
                                  "constrained_decoding": False, "stream_buffered": True},
            "engine": (getattr(self.engine, "info", {}) or {}).get("version"),
            "started": int(self.started_at), "uptime_s": int(time.time() - self.started_at),
            "cache_max_tokens": ctx, "context": {"native": ctx, "max_positions": ctx},
            "concurrency": {"serving": slots, "requested": slots},
            "dialects": ["/v1/chat/completions"],
            "vision": {"enabled": False, "available": False, "error": None},
            "activity": {"requests": totals["requests"] + int(busy), "in_flight": int(busy) + int(s.get("queued") or 0),
                         "last_request_at": int(last_at) if last_at else None},
            "last_timings": last_t, "vram": {"elastic": False},
            "machine": {"at": int(time.time()), "gpu": None,
                        "ram": {"used_gib": round(hw["ram_used"] / 2**30, 1),
                                "total_gib": round(hw["ram_total"] / 2**30, 1)} if hw.get("ram_total") else None}}


def telemetry() -> dict:
    """RAM from /proc/meminfo; no NVML here, so no gpu_* readings (absent, as Strata's sampler leaves them)."""
    out = {}
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            info[k] = int(v.split()[0]) * 1024
        out["ram_total"] = info["MemTotal"]
        out["ram_used"] = info["MemTotal"] - info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError, IndexError):
        pass
    return out


def request_timings(prompt_tokens: int, generated: int, last: dict):
    if last.get("prompt_ms") is None:
        return None
    cache_n = int(last.get("reused") or 0)
    prompt_n, prompt_ms = max(0, prompt_tokens - cache_n), float(last["prompt_ms"])
    decode_ms = float(last.get("decode_ms") or 0)
    decoded = int(last.get("generated") or generated)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 1),
            "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else None,
            "prompt_per_second": round(prompt_n / (prompt_ms / 1000), 1) if prompt_n and prompt_ms > 0 else None,
            "predicted_n": generated, "predicted_ms": round(decode_ms, 1),
            "predicted_per_token_ms": round(decode_ms / decoded, 3) if decoded else None,
            "predicted_per_second": round(decoded / (decode_ms / 1000), 1) if decoded and decode_ms > 0 else None,
            **({"draft_n": int(last["drafts_offered"]), "draft_n_accepted": int(last["drafts_accepted"])}
               if last.get("drafts_offered") is not None else {})}


class ThinkParser:
    """Text in; ("reasoning", text) until </think>, then ("content", text). A tag cut between two pieces is held."""

    def __init__(self, thinking: bool):
        self.state = "reasoning" if thinking else "content"
        self.buf = ""
        self.lead = True                     # the answer's leading blank lines after </think> are dropped

    def feed(self, text: str) -> list:
        self.buf += text
        out = []
        if self.state == "reasoning":
            at = self.buf.find(THINK_END)
            if at < 0:
                keep = next((k for k in range(min(len(THINK_END) - 1, len(self.buf)), 0, -1)
                             if THINK_END.startswith(self.buf[-k:])), 0)
                emit, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if emit:
                    out.append(("reasoning", emit))
                return out
            if at:
                out.append(("reasoning", self.buf[:at]))
            self.buf, self.state = self.buf[at + len(THINK_END):], "content"
        if self.lead:
            self.buf = self.buf.lstrip("\n")
            if not self.buf:
                return out
            self.lead = False
        if self.buf:
            out.append(("content", self.buf))
        self.buf = ""
        return out

    def finish(self) -> list:
        out = [(self.state, self.buf)] if self.buf else []
        self.buf = ""
        return out


def openai_chunks(svc: Service, req: dict, ids, thinking, max_new, cancel):
    cid, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())
    model = svc.model

    def chunk(delta, finish=None):
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    for kind, x in svc.run(ids, thinking, max_new, req, cancel):
        if kind == "ping":
            yield None
        elif kind == "event":
            k, text = x
            if text:
                yield chunk({"reasoning_content": text} if k == "reasoning" else {"content": text})
        else:
            last = chunk({}, {"cancel": "stop"}.get(x["finish"], x["finish"]))
            pt = len(ids)
            last["usage"] = {"prompt_tokens": pt, "completion_tokens": x["completion_tokens"],
                             "total_tokens": pt + x["completion_tokens"],
                             "prompt_tokens_details": {"cached_tokens": x.get("reused") or 0}}
            if x.get("timings"):
                last["timings"] = x["timings"]
            yield last


def openai_collect(chunks) -> dict:
    content, reasoning, last = [], [], None
    for c in chunks:
        if c is None:
            continue
        d = c["choices"][0]["delta"]
        content.append(d.get("content") or "")
        reasoning.append(d.get("reasoning_content") or "")
        last = c
    msg = {"role": "assistant", "content": "".join(content) or None}
    if "".join(reasoning):
        msg["reasoning_content"] = "".join(reasoning)
    out = {"id": last["id"], "object": "chat.completion", "created": last["created"], "model": last["model"],
           "choices": [{"index": 0, "message": msg, "finish_reason": last["choices"][0]["finish_reason"]}],
           "usage": last["usage"]}
    if last.get("timings"):
        out["timings"] = last["timings"]
    return out


# ------------------------------------------------------------------------------------------------ Prometheus
def prometheus_vllm(m: dict) -> str:
    """serve/prometheus.py @6c0f3ce `render`: vLLM's names, then strata:* named after the JSON's keys."""
    model = str((m.get("engine") or {}).get("model") or "strata").replace("\\", "\\\\").replace('"', '\\"')
    lab = f'model_name="{model}"'
    live, totals, eng = m.get("live") or {}, m.get("totals") or {}, m.get("engine") or {}
    out = []

    def metric(name, kind, help_, value, labels=""):
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{{{lab}{labels}}} {value}")

    busy = live.get("state") in ("reading", "generating")
    ctx = eng.get("max_context") or 0
    used = (live.get("prompt_tokens") or 0) + (live.get("generated") or 0) if busy else 0
    metric("vllm:num_requests_running", "gauge", "Requests reading their prompt or generating.", int(busy))
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting for their turn.", live.get("queued") or 0)
    metric("vllm:kv_cache_usage_perc", "gauge", "The running request's share of the context (1 = full).",
           round(min(1.0, used / ctx), 4) if ctx else 0)
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of the finished requests.",
           totals.get("prompt_tokens", 0))
    metric("vllm:generation_tokens_total", "counter", "Generated tokens.", totals.get("output_tokens", 0))
    metric("vllm:request_success_total", "counter", "Finished requests.", totals.get("requests", 0))
    metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prompt cache.",
           totals.get("prompt_tokens", 0))
    metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens the prompt cache already held.",
           totals.get("reused", 0))
    for state in ("unloaded", "idle", "reading", "generating"):
        out.append(f'strata:live_state{{{lab},state="{state}"}} {int(live.get("state") == state)}')
    out.append(f"strata:live_tok_s{{{lab}}} {live.get('tok_s') or 0}")
    if isinstance(eng.get("max_context"), int):
        out.append(f"strata:engine_max_context{{{lab}}} {eng['max_context']}")
    out.append(f"strata:totals_prompt_seconds_total{{{lab}}} {round((totals.get('prompt_ms') or 0) / 1000, 3)}")
    out.append(f"strata:totals_decode_seconds_total{{{lab}}} {round((totals.get('decode_ms') or 0) / 1000, 3)}")
    reqs = m.get("requests") or []
    if reqs and isinstance(reqs[0].get("hit_rate"), (int, float)):
        out.append(f"strata:last_hit_rate{{{lab}}} {reqs[0]['hit_rate']}")
    if reqs and isinstance(reqs[0].get("decode_tok_s"), (int, float)):
        out.append(f"strata:last_decode_tok_s{{{lab}}} {reqs[0]['decode_tok_s']}")
    return "\n".join(out) + "\n"


def prometheus_llamacpp(m: dict, loaded: bool) -> str:
    """/metrics/prometheus: llama.cpp's names (names as tests/data/strata/metrics_prometheus_llamacpp.txt lists)."""
    t, live = m.get("totals") or {}, m.get("live") or {}
    prompt_n = max(0, (t.get("prompt_tokens") or 0) - (t.get("reused") or 0))
    rows = [
        ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens read", prompt_n),
        ("llamacpp:prompt_tokens_cached_total", "counter", "Prompt tokens the conversation cache already held",
         t.get("reused") or 0),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt read time", round((t.get("prompt_ms") or 0) / 1000, 4)),
        ("llamacpp:tokens_predicted_total", "counter", "Tokens generated", t.get("output_tokens") or 0),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Generation time",
         round((t.get("decode_ms") or 0) / 1000, 4)),
        ("llamacpp:requests_processing", "gauge", "Requests running",
         int(live.get("state") in ("reading", "generating"))),
        ("llamacpp:requests_deferred", "gauge", "Requests waiting their turn", live.get("queued") or 0),
        ("strata:requests_total", "counter", "Requests finished", t.get("requests") or 0),
        ("strata:model_loaded", "gauge", "1 while the model is loaded", int(loaded)),
    ]
    return "".join(f"# HELP {n} {h}\n# TYPE {n} {k}\n{n} {v}\n" for n, k, h, v in rows)


# ------------------------------------------------------------------------------------------------ HTTP
def make_handler(svc: Service):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"                       # SSE ends by closing the connection
        sse_started = False

        def log_message(self, fmt, *args):
            pass

        def end_headers(self):
            self.send_header("Connection", "close")
            super().end_headers()

        def parse_request(self):
            if not super().parse_request():
                return False
            if svc.api_key or host_allowed(self.headers.get("Host")):
                return True
            self._json(403, {"error": {"type": "forbidden", "message":
                                       f"Host {self.headers.get('Host')!r} is not allowed (DNS rebinding protection)"}})
            return False

        def _json(self, code, obj):
            body = json.dumps(obj, ensure_ascii=False).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _text(self, body: str, ctype="text/plain; version=0.0.4; charset=utf-8"):
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if not svc.api_key:
                return True
            auth = self.headers.get("Authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else self.headers.get("x-api-key", "")
            if key_matches(given, svc.api_key):
                return True
            self._json(401, {"error": {"type": "authentication_error", "message": "missing or wrong API key"}})
            return False

        def _body(self) -> bytes:
            try:
                n = int(self.headers.get("Content-Length", 0))
            except ValueError:
                n = 0
            return self.rfile.read(n) if n > 0 else b""

        def do_GET(self):
            path = self.path.split("?")[0].rstrip("/")
            query = urlsplit(self.path).query
            if path in ("/health", "/api/health"):
                self._json(200, {"status": "ok", "max_context": svc.reported_ctx(), "model": svc.model,
                                 "images": False, "api_key": bool(svc.api_key), "loaded": svc.loaded(),
                                 "service": "strata"})
            elif path == "/metrics/prometheus":
                if self._authorized():
                    self._text(prometheus_llamacpp(svc.metrics(), svc.loaded()))
            elif path == "/metrics":
                accept = self.headers.get("Accept", "") or ""
                if "format=prometheus" in query or "openmetrics" in accept or "text/plain" in accept:
                    if self._authorized():
                        self._text(prometheus_vllm(svc.metrics()))
                    return
                if self._authorized():
                    self._json(200, svc.metrics(all_requests="requests=all" in self.path))
            elif path == "/status":
                if not self._authorized():
                    return
                with svc.status_lock:
                    s = dict(svc.status)
                if s.get("busy"):
                    s["elapsed_s"] = round(time.time() - s["started"], 1)
                    if s.get("first_token"):
                        s["tokens_per_s"] = round(svc._tok_s(), 1)
                        s["tokens_per_s_mean"] = round(svc._tok_s_mean(), 1)
                for k in ("started", "first_token"):
                    s.pop(k, None)
                self._json(200, s)
            elif path in ("/v1/models", "/models"):
                if self._authorized():
                    loaded = svc.loaded()
                    model = {"id": svc.model, "object": "model", "status": {"value": "loaded"},
                             "meta": {"n_ctx": svc.reported_ctx()},
                             "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]}}
                    if not loaded and getattr(svc.engine, "unloaded", False):
                        model["status"] = {"value": "unloaded"}
                        loaded = True
                    self._json(200, {"object": "list", "data": [model] if loaded else []})
            elif path == "/props":
                if self._authorized():
                    if not svc.loaded() and not getattr(svc.engine, "unloaded", False):
                        self._json(503, {"error": {"message": "the engine is not running"}})
                        return
                    props = {"default_generation_settings": {"n_ctx": svc.reported_ctx(), "params": {"n_predict": -1}},
                             "total_slots": max(1, int(getattr(svc.engine, "batch", 0) or 0)),
                             "model_alias": svc.model, "chat_template": svc.template_text, "chat_template_caps": {},
                             "modalities": {"vision": False}, "models_autoload": hasattr(svc.engine, "restart"),
                             "is_sleeping": not svc.loaded()}
                    if getattr(svc.engine, "model_path", None):
                        props["model_path"] = svc.engine.model_path
                    version = (getattr(svc.engine, "info", {}) or {}).get("version")
                    if version:
                        props["build_info"] = "Strata " + str(version)
                    self._json(200, props)
            elif path == "/slots":
                if self._authorized():
                    with svc.status_lock:
                        busy = bool(svc.status.get("busy"))
                        in_use = int(svc.status.get("prompt_tokens") or 0)
                    slots = [{"id": 0, "n_ctx": svc.reported_ctx(), "is_processing": busy, "n_prompt_tokens": in_use}]
                    self._json(200, slots if svc.loaded() else [])
            elif path == "/v1/status":
                if self._authorized():
                    self._json(200, svc.v1_status())
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self):
            path = self.path.split("?")[0].rstrip("/")
            body = self._body()
            if not self._authorized():
                return
            if path != "/v1/chat/completions":
                self._json(404, {"error": {"message": "not found"}})
                return
            cancel = threading.Event()
            try:
                req = json.loads(body or b"{}")
                if not isinstance(req, dict):
                    raise ValueError("send a JSON object")
                ids, thinking, max_new = svc.prepare(req)
                chunks = openai_chunks(svc, req, ids, thinking, max_new, cancel)
                if not req.get("stream"):
                    self._json(200, openai_collect(chunks))
                    return
            except ValueError as e:
                self._json(400, {"error": {"type": "invalid_request_error", "message": str(e)}})
                return
            except EngineDied as e:
                self._json(503, {"error": {"type": "server_error", "message": f"{e}; the next request restarts it"}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            try:
                for c in chunks:
                    if c is None:
                        self.wfile.write(b": keep-alive\n\n")
                    else:
                        self.wfile.write(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except OSError:
                cancel.set()                                 # the client went away: stop the engine
                chunks.close()
            except EngineDied as e:                          # mid-stream: say so, then end the stream properly
                err = {"error": {"type": "server_error", "message": f"{e}; the next request restarts it"}}
                self.wfile.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            except ValueError as e:                          # the engine's ERR after the stream started
                err = {"error": {"type": "server_error", "message": str(e)}}
                self.wfile.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")

    return Handler


class Server(ThreadingHTTPServer):
    allow_reuse_address = os.name != "nt"
    daemon_threads = True
    request_queue_size = 256


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["mock", "strata"], default="mock")
    ap.add_argument("--config")
    ap.add_argument("--host", default=None)
    ap.add_argument("--script", action="append")
    ap.add_argument("--port", type=int, default=8095)
    ap.add_argument("--gpu")
    ap.add_argument("--tokenizer", default=str(ROOT / "pack/full/tokenizer"))
    ap.add_argument("--open", action="store_true")
    ap.add_argument("--fit-max-tokens", action="store_true")
    ap.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY", ""))
    ap.add_argument("--lazy", action="store_true")
    a = ap.parse_args()
    cfg = json.loads(Path(a.config).read_text(encoding="utf-8-sig")) if a.config else {}
    if a.gpu is not None:
        cfg["gpu"] = int(a.gpu) if a.gpu.strip().isdigit() else a.gpu
    a.host = a.host or cfg.get("host") or "127.0.0.1"
    try:                                                # before the minutes of loading: is the port free?
        Server((a.host, a.port), BaseHTTPRequestHandler).server_close()
    except OSError as e:
        ap.error(f"port {a.port} is already in use - is Strata (or another server) already running? Close it, or "
                 "start this one with a different --port" if e.errno == errno.EADDRINUSE else
                 f"cannot listen on {a.host}:{a.port}: {e.strerror or e}")
    if cfg.get("tokenizer"):
        a.tokenizer = cfg["tokenizer"]
    tpath = Path(a.tokenizer)
    if a.engine == "strata" and not (tpath / "vocab.json").exists():
        ap.error(f"the model's tokenizer is missing ({tpath / 'vocab.json'}); run setup again")
    tok = ST.Tokenizer.from_dir(tpath) if (tpath / "vocab.json").exists() else ByteTokenizer()
    if a.engine == "strata":
        if not cfg:
            ap.error("--engine strata needs --config")
        lazy = a.lazy or cfg.get("lazy_load") is True
        print("model unloaded; the first request loads it ..." if lazy else
              "loading the model (the first start takes a minute or two) ...", flush=True)
        exe = cfg["exe"] if os.path.isabs(cfg["exe"]) else \
            os.path.abspath(os.path.join(cfg.get("cwd") or ".", cfg["exe"]))
        engine = StrataEngine(exe, engine_args(cfg), cwd=cfg.get("cwd"), log=cfg.get("log"), env=child_env(cfg),
                              lazy=lazy)
        asked = next((int(engine.args[engine.args.index(k) + 1]) for k in ("--batch", "--slots")
                      if k in engine.args), 0)
        if asked and not lazy and int(engine.info.get("batch_slots") or 0) != asked:
            print(f"[strata] parallel requests: {asked} asked, the engine runs "
                  f"{int(engine.info.get('batch_slots') or 0) or 'one at a time'} (its log says why)", flush=True)
    else:
        engine = MockEngine(tok, "\n".join(a.script) if a.script else MOCK_SCRIPT)
    tpl = tpath / "chat_template.jinja"
    svc = Service(engine, tok, cfg.get("model_name", "qwen3.8-flash-next"),
                  tpl.read_text(encoding="utf-8") if tpl.exists() else "")
    if (("STRATA_API_KEY" in os.environ and not os.environ["STRATA_API_KEY"].strip()) or
            any(x == "--api-key" and i + 1 < len(sys.argv) and not sys.argv[i + 1].strip() or x.strip() == "--api-key="
                for i, x in enumerate(sys.argv))):
        print("[strata] an API key was given but it is empty: set a key, or leave --api-key / STRATA_API_KEY out",
              file=sys.stderr)
        engine.close()
        return 2
    key = a.api_key or cfg.get("api_key", "")
    if isinstance(key, str) and key and not key_list(key):
        print('[strata] an API key was given but it is empty: set a key, or leave --api-key / STRATA_API_KEY / '
              '"api_key" out', file=sys.stderr)
        engine.close()
        return 2
    svc.api_key = key.strip() if isinstance(key, str) else key
    httpd = Server((a.host, a.port), make_handler(svc))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"ready: http://{a.host}:{a.port}/v1  (OpenAI: /v1/chat/completions, context {engine.max_context} tokens"
          f"{', API key required' if svc.api_key else ''})", flush=True)

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("\n[strata] stopping (Ctrl+C again to end the engine at once) ...", flush=True)
        for close in (httpd.shutdown, engine.close):
            try:
                close()
            except KeyboardInterrupt:                   # a second Ctrl+C / SIGTERM: the engine is killed at once
                if getattr(engine, "proc", None):
                    engine.proc.kill()
        print("[strata] stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
