"""The InferenceKey backend's artifact (the SDK's package_backend, read back with read_manifest_from_archive) and its
publication against a stand-in control plane on loopback (a real http.server that records the multipart upload and
answers as inferencekey/publish.py expects: JSON on 2xx, 401/403/400 with a body)."""

from __future__ import annotations

import email
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("inferencekey")

from inferencekey.backend import read_manifest_from_archive  # noqa: E402

from engine_manager.inferencekey import ENTRYPOINT, SLUG  # noqa: E402
from engine_manager.inferencekey.artifact import (  # noqa: E402
    InferenceKeyError,
    control_token,
    package,
    publish,
    workload_spec,
)
from loopback_http import LoopbackServer, QuietHandler  # noqa: E402

TOKEN = "ik_sdk_test-0123456789abcdef"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return package(tmp_path_factory.mktemp("dist"))


def test_the_artifact_holds_the_backend_and_the_core_and_nothing_else(artifact):
    m = read_manifest_from_archive(artifact.path)
    assert m["name"] == m["slug"] == SLUG and m["task_type"] == "text2text" and m["entrypoint"] == ENTRYPOINT
    with tarfile.open(artifact.path, "r:gz") as tar:
        names = tar.getnames()
        reqs = tar.extractfile("requirements.txt").read().decode().split()  # type: ignore[union-attr]
        code = {n: tar.extractfile(n).read() for n in names if n.endswith(".py")}  # type: ignore[union-attr]
    print(f"artifact: {len(names)} files, {artifact.size_bytes:,} bytes")
    for needed in ("manifest.json", "requirements.txt", "engine_manager/inferencekey/backend.py",
                   "engine_manager/session.py", "engine_manager/supervisor.py", "engine_manager/keeper.py",
                   "engine_manager/chat.py", "engine_manager/settings.py", "resources/manifests/model.json",
                   "resources/manifests/engine.json"):
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("app/", "tests/", "engine_manager/testing"))]
    assert not [n for n in names if Path(n).suffix in (".gguf", ".so", ".bin", ".pyc", ".whl")]
    assert not [n for n, src in code.items() if b"import PySide6" in src or b"from PySide6" in src]
    assert any(r.startswith("inferencekey==") for r in reqs) and any(r.startswith("pydantic") for r in reqs)
    assert not [r for r in reqs if r.lower().startswith(("pyside6", "pyqtgraph", "superqt"))]
    assert artifact.size_bytes < 2_000_000          # code only: no weights, no engine binary


def test_the_cli_packages_and_prints_the_size(tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine_manager", "inferencekey", "package", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "bytes" in r.stdout and SLUG in r.stdout
    assert read_manifest_from_archive(str(next(tmp_path.glob("*.tar.gz"))))["slug"] == SLUG


class ControlPlane:
    """Answers POST /api/tenants/<tenant>/custom-backends as the SDK expects and records what it got."""

    def __init__(self, status: int = 201, body: dict | None = None):
        self.requests: list[dict] = []
        plane = self

        class H(QuietHandler):
            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                msg = email.message_from_bytes(b"Content-Type: " + self.headers["Content-Type"].encode()
                                               + b"\r\nMIME-Version: 1.0\r\n\r\n" + raw)
                parts = {p.get_param("name", header="content-disposition"): p.get_payload(decode=True)
                         for p in msg.walk() if not p.is_multipart()}
                plane.requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                       "parts": parts})
                answer = body if body is not None else {"id": "cb_1", "slug": parts["slug"].decode(),
                                                        "sha256": "x"}
                self._send(status, "application/json", json.dumps(answer).encode())

        self.server = LoopbackServer(H)

    @property
    def url(self) -> str:
        return self.server.base_url


@pytest.fixture
def plane():
    made: list[ControlPlane] = []

    def make(*a, **kw) -> ControlPlane:
        p = ControlPlane(*a, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.server.stop()


def test_publish_uploads_the_artifact_with_the_bearer_token(artifact, plane):
    cp = plane()
    rec = publish(artifact.path, tenant="tenant-1", token=TOKEN, base_url=cp.url)
    assert rec["slug"] == SLUG
    (req,) = cp.requests
    assert req["path"] == "/api/tenants/tenant-1/custom-backends" and req["auth"] == f"Bearer {TOKEN}"
    p = req["parts"]
    assert p["name"] == p["slug"] == SLUG.encode() and p["task_type"] == b"text2text"
    assert p["entrypoint"] == ENTRYPOINT.encode() and p["version"]
    assert p["file"] == Path(artifact.path).read_bytes()


@pytest.mark.parametrize("status,words", [(401, "refused the token"), (403, "may not publish"),
                                          (400, "refused the upload")])
def test_publish_errors_are_plain_words_without_the_token(artifact, plane, status, words):
    cp = plane(status, {"error": f"no ({TOKEN})"})
    with pytest.raises(InferenceKeyError) as ei:
        publish(artifact.path, tenant="t", token=TOKEN, base_url=cp.url)
    assert words in str(ei.value) and str(status) in str(ei.value)
    assert TOKEN not in str(ei.value)


def test_the_cli_publishes_with_the_token_from_the_environment_only(artifact, plane, tmp_path):
    cp = plane()
    env = {**os.environ, "INFERENCEKEY_SDK_TOKEN": TOKEN, "INFERENCEKEY_BASE_URL": cp.url,
           "INFERENCEKEY_TENANT": "tenant-9"}
    r = subprocess.run([sys.executable, "-m", "engine_manager", "inferencekey", "publish", "--package",
                        artifact.path], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "published" in r.stdout and TOKEN not in r.stdout + r.stderr
    assert cp.requests[0]["auth"] == f"Bearer {TOKEN}" and cp.requests[0]["path"].startswith("/api/tenants/tenant-9/")
    env.pop("INFERENCEKEY_SDK_TOKEN")
    env["PYTHON_KEYRING_BACKEND"] = "keyring.backends.null.Keyring"
    r = subprocess.run([sys.executable, "-m", "engine_manager", "inferencekey", "publish", "--package",
                        artifact.path], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "INFERENCEKEY_SDK_TOKEN" in r.stderr and len(cp.requests) == 1


def test_control_token_comes_from_the_environment_and_its_absence_is_said(monkeypatch):
    assert control_token({"INFERENCEKEY_SDK_TOKEN": TOKEN}) == TOKEN
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")
    with pytest.raises(InferenceKeyError, match="never taken from the command line"):
        control_token({})


def test_the_workload_names_the_published_backend_on_the_private_worker():
    spec = workload_spec("wrk_1", project="acme").to_wire()
    assert spec["backend"] == SLUG and spec["task_type"] == "text2text" and spec["worker_id"] == "wrk_1"
    assert spec["execution_policy"] == "fixed" and spec["execution_policy_config"] == {"replicas": 1}
    with pytest.raises(InferenceKeyError, match="worker"):
        workload_spec("")
