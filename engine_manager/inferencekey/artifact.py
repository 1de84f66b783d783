"""Package, publish and deploy the InferenceKey backend with the SDK's own functions.

- :func:`package` — ``package_backend`` (inferencekey/backend/packaging.py): the source folder's *contents* go to the
  archive's root, which the worker puts on PYTHONPATH (``_collect_code_members``). Staged: ``engine_manager/``
  (without ``engine_manager/testing`` and caches) and ``resources/manifests/`` (``paths.resources_dir`` finds them
  beside the package). No Qt, no weights, no binary: a staged file with a binary suffix refuses the build.
- :func:`publish` — ``publish_custom_backend`` (inferencekey/publish.py: multipart POST to
  ``{base}/api/tenants/{tenant}/custom-backends``; 401/403/400 as ``AuthError``/``PermissionDenied``/
  ``ValidationError``), its errors said in plain words.
- :func:`workload_spec` / :func:`deploy` — the ``WorkloadSpec`` naming the published backend by its slug
  (docs/.../guides/custom-backends.mdx "Use it in a workload"; examples/chronos2-forecast-private-amd-gfx120x/main.py:
  ``backend``, ``worker_id``, ``ExecutionPolicy.FIXED``, one replica), ``ManagementClient.ensure`` and
  ``wait_until_ready`` (inferencekey/clients.py).
The control token (``ik_sdk_…``) comes from ``INFERENCEKEY_SDK_TOKEN`` (``ManagementClient.from_env``) or the OS
keyring, never from a command line; it is never printed, and a server's answer that echoes it is masked.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import __version__, paths
from ..engines.base import mask_in
from ..errors import UserError
from . import ENTRYPOINT, MODEL, SLUG, TASK_TYPE

DIST_NAME = "dsv41-panel"
#: the GUI's packages: never in the artifact's requirements (the backend runs without a display)
GUI_PACKAGES = frozenset({"pyside6-essentials", "pyside6", "pyqtgraph", "superqt"})
#: what no staged file may be: weights, engine binaries, native libraries, archives
BINARY_SUFFIXES = frozenset({".gguf", ".bin", ".so", ".dylib", ".dll", ".exe", ".pt", ".pth", ".safetensors",
                             ".tar", ".gz", ".zip", ".whl", ".npy", ".strp", ".pyc"})
KEYRING_SERVICE = "dsv41-panel/inferencekey"
KEYRING_USER = "sdk-token"
TOKEN_ENV = "INFERENCEKEY_SDK_TOKEN"
TENANT_ENV = "INFERENCEKEY_TENANT"
READY_TIMEOUT_ENV = "IK_READY_TIMEOUT"
KEEP_ALIVE_ENV = "IK_KEEP_ALIVE"
DEFAULT_READY_TIMEOUT_S = 7200.0


class InferenceKeyError(UserError):
    """A step with the platform failed; ``str()`` says what and what to do."""


# -- package ----------------------------------------------------------------------------------------------------

def requirements_lines() -> list[str]:
    """The core's run-time requirements (this distribution's, without the GUI's packages and the extras), and the
    SDK pinned to the version installed here (the one the tests ran against)."""
    out: list[str] = []
    for req in metadata.requires(DIST_NAME) or []:
        if "extra ==" in req.replace('"', " ").replace("'", " ") or "extra==" in req:
            continue
        name = req.split(";")[0].strip()
        base = name.split("[")[0]
        for ch in "<>=!~ ":
            base = base.split(ch)[0]
        if base.lower() in GUI_PACKAGES:
            continue
        out.append(name)
    out.append(f"inferencekey=={metadata.version('inferencekey')}")
    return out


def stage(dest: Path) -> Path:
    """Copy what the artifact holds into ``dest`` (which must not exist): ``engine_manager/`` and
    ``resources/manifests/``. Refuses a file with a binary suffix (:data:`BINARY_SUFFIXES`)."""
    import engine_manager

    src = Path(engine_manager.__file__).resolve().parent
    shutil.copytree(src, dest / "engine_manager",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache", "testing"))
    manifests = paths.resources_dir() / "manifests"
    if manifests.is_dir():
        shutil.copytree(manifests, dest / "resources" / "manifests",
                        ignore=shutil.ignore_patterns("*.bak*", ".*"))
    bad = [p.relative_to(dest).as_posix() for p in dest.rglob("*")
           if p.is_symlink() or (p.is_file() and "".join(p.suffixes[-1:]).lower() in BINARY_SUFFIXES)]
    if bad:
        raise InferenceKeyError(f"The backend artifact would carry files that are not code: {', '.join(bad[:5])}. "
                                "Remove them from the source tree and package again.")
    return dest


def package(out_dir: Path | str) -> Any:
    """Build ``<out_dir>/deepseek-v41-flash-one-gpu-<version>.tar.gz`` with the SDK's ``package_backend``; returns
    its ``BackendPackage`` (path, sha256, size_bytes, manifest)."""
    from inferencekey.backend import package_backend
    from inferencekey.errors import PackagingError

    with tempfile.TemporaryDirectory(prefix="dsv41-ik-") as tmp:
        src = stage(Path(tmp) / "src")
        req = Path(tmp) / "requirements.txt"
        req.write_text("\n".join(requirements_lines()) + "\n", encoding="utf-8")
        try:
            return package_backend(src=str(src), entrypoint=ENTRYPOINT, name=SLUG, slug=SLUG, version=__version__,
                                   task_type=TASK_TYPE, requirements=str(req), requires_python=">=3.11",
                                   description="DeepSeek-V4.1-Flash (763B MoE, Q2_K) on one GPU: the Strata engine "
                                               "with a planned VRAM hot set (dsv41 panel core)",
                                   out_dir=str(out_dir))
        except PackagingError as exc:
            raise InferenceKeyError(f"Packaging the backend failed: {exc}") from None


# -- tokens -----------------------------------------------------------------------------------------------------

def control_token(env: Mapping[str, str] | None = None) -> str:
    """The control token: ``INFERENCEKEY_SDK_TOKEN``, else the OS keyring (``dsv41-panel/inferencekey``)."""
    env = os.environ if env is None else env
    token = (env.get(TOKEN_ENV) or "").strip()
    if token:
        return token
    try:
        import keyring

        token = (keyring.get_password(KEYRING_SERVICE, KEYRING_USER) or "").strip()
    except Exception:  # no keyring backend here: the environment is the way
        token = ""
    if token:
        return token
    raise InferenceKeyError(f"No InferenceKey control token: set {TOKEN_ENV} (an ik_sdk_… token from the dashboard) "
                            f"in the environment, or store it in the keyring (service {KEYRING_SERVICE!r}, user "
                            f"{KEYRING_USER!r}). It is never taken from the command line.")


# -- publish ----------------------------------------------------------------------------------------------------

def publish(package_path: Path | str, *, tenant: str, token: str, base_url: str | None = None) -> dict[str, Any]:
    """Upload the artifact with ``publish_custom_backend``; the record the platform answered (id, slug, sha256…).
    Raises :class:`InferenceKeyError` in plain words for 401/403/400 and anything else."""
    from inferencekey import publish_custom_backend
    from inferencekey.errors import (ApiError, AuthError, ConfigurationError, PackagingError, PermissionDenied,
                                     ValidationError)

    if not tenant:
        raise InferenceKeyError(f"No tenant: pass --tenant (your tenant's id, from the dashboard) or set "
                                f"{TENANT_ENV}.")

    def said(exc: Exception) -> str:
        return mask_in(str(exc), [token])[:500]

    try:
        answer = publish_custom_backend(tenant, str(package_path), token=token, base_url=base_url)
    except AuthError as exc:
        raise InferenceKeyError(f"The platform refused the token (401: {said(exc)}). Check {TOKEN_ENV}: it must be "
                                "a valid control token (ik_sdk_…) that has not been revoked.") from None
    except PermissionDenied as exc:
        raise InferenceKeyError(f"The token may not publish backends for tenant {tenant} (403: {said(exc)}). Use a "
                                "control token of that tenant with the right to publish.") from None
    except ValidationError as exc:
        raise InferenceKeyError(f"The platform refused the upload (400: {said(exc)}). Fix what it names and publish "
                                "again.") from None
    except (PackagingError, ConfigurationError) as exc:
        raise InferenceKeyError(f"The artifact cannot be published: {said(exc)}. Package it again with "
                                "`dsv41 inferencekey package`.") from None
    except ApiError as exc:
        raise InferenceKeyError(f"Publishing failed: {said(exc)}. Check INFERENCEKEY_BASE_URL and the network, then "
                                "publish again.") from None
    if not isinstance(answer, dict):
        raise InferenceKeyError("The platform answered the upload with something that is not a record.")
    return answer


# -- deploy -----------------------------------------------------------------------------------------------------

def workload_spec(worker_id: str, *, workload_slug: str = SLUG, project: str | None = None) -> Any:
    """The workload running the published backend on one private worker, one always-on replica."""
    from inferencekey import ExecutionPolicy, WorkloadSpec

    if not worker_id:
        raise InferenceKeyError("No worker: pass --worker-id (your registered worker's id, wrk_…; the dashboard's "
                                "Workers page) or set IK_WORKER_ID.")
    return WorkloadSpec(name=f"{MODEL} on one GPU", slug=workload_slug, model=MODEL, backend=SLUG,
                        task_type=TASK_TYPE, project=project, worker_id=worker_id,
                        execution_policy=ExecutionPolicy.FIXED, execution_policy_config={"replicas": 1})


@dataclass
class DeployOptions:
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    keep_alive: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "DeployOptions":
        env = os.environ if env is None else env
        raw = (env.get(READY_TIMEOUT_ENV) or "").strip()
        try:
            timeout = float(raw) if raw else DEFAULT_READY_TIMEOUT_S
        except ValueError:
            raise InferenceKeyError(f"{READY_TIMEOUT_ENV}={raw!r} is not a number of seconds.") from None
        if not 1 <= timeout <= 172_800:
            raise InferenceKeyError(f"{READY_TIMEOUT_ENV}={raw} must be from 1 to 172800 seconds.")
        keep = (env.get(KEEP_ALIVE_ENV) or "1").strip().lower() not in ("0", "false", "no", "off")
        return cls(timeout, keep)


def deploy(spec: Any, *, token: str, options: DeployOptions, base_url: str | None = None,
           say: Callable[[str], None] = print) -> Any:
    """``ensure()`` the workload, then wait until it serves (the first start downloads 264.5 GB and loads it:
    ``IK_READY_TIMEOUT``, 7200 s by default). With ``IK_KEEP_ALIVE=0`` a failed or interrupted wait deletes the
    workload again (its GPU stops billing); by default it is kept."""
    from inferencekey import ManagementClient
    from inferencekey.errors import InferenceKeyError as SdkError

    mgmt = ManagementClient.from_env(base_url=base_url, sdk_token=token, project=spec.project)
    try:
        ref = mgmt.ensure(spec)
    except SdkError as exc:
        raise InferenceKeyError(f"The workload could not be created: {mask_in(str(exc), [token])}") from None
    say(f"workload {ref.project_slug}/{ref.workload_slug}: waiting until it serves (up to "
        f"{options.ready_timeout_s:.0f} s; the first start downloads and loads the model)…")
    try:
        mgmt.wait_until_ready(ref.workload_slug, timeout=options.ready_timeout_s)
    except (SdkError, TimeoutError, KeyboardInterrupt) as exc:
        if not options.keep_alive:
            say(f"{KEEP_ALIVE_ENV}=0: deleting the workload {ref.workload_slug}")
            mgmt.delete(ref.workload_slug)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise InferenceKeyError(f"The workload did not become ready: {mask_in(str(exc), [token])}. The worker's log "
                                "shows the backend's setup lines.") from None
    return ref
