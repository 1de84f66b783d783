"""``dsv41 inferencekey package|publish|deploy|serve``: the InferenceKey custom backend (engine_manager.inferencekey).

- ``package [--out DIR]`` — the artifact (the SDK's ``package_backend``), its file count and size printed;
- ``publish [--package FILE] [--tenant ID] [--base-url URL]`` — uploads it (``publish_custom_backend``); the
  control token from ``INFERENCEKEY_SDK_TOKEN`` or the keyring, never an argument;
- ``deploy --worker-id ID [--project P] [--slug S]`` — ``WorkloadSpec`` + ``ensure()``, then waits until it serves
  (``IK_READY_TIMEOUT``, default 7200 s; ``IK_KEEP_ALIVE=0`` deletes it again when the wait fails);
- ``serve [--port N]`` — runs the backend here through the SDK's own runtime, as a worker does
  (``python -m inferencekey.backend.serve``).

The SDK is an extra (``pip install 'dsv41-panel[inferencekey]'``): without it every sub-command says so (exit 1) and
the rest of ``dsv41`` works. Nothing is imported from it before a sub-command runs.
"""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

from ..exitcodes import ExitCode


def register(sub) -> None:
    p = sub.add_parser("inferencekey", help="package, publish, deploy or serve the InferenceKey custom backend",
                       description="The InferenceKey custom backend: the engine on an InferenceKey worker, called "
                                   "through the platform's endpoint.")
    s = p.add_subparsers(dest="ik_command", metavar="STEP")
    pk = s.add_parser("package", help="build the backend's artifact (.tar.gz) with the SDK")
    pk.add_argument("--out", default="dist", help="folder for the artifact (default: dist)")
    pk.set_defaults(func=run_package)
    pb = s.add_parser("publish", help="upload the artifact to your tenant (token from INFERENCEKEY_SDK_TOKEN or the "
                                      "keyring)")
    pb.add_argument("--package", help="the artifact (default: build one now into a temporary folder)")
    pb.add_argument("--tenant", default=None, help="tenant id (default: $INFERENCEKEY_TENANT)")
    pb.add_argument("--base-url", default=None, help="control plane (default: $INFERENCEKEY_BASE_URL, else the "
                                                     "SDK's)")
    pb.set_defaults(func=run_publish)
    dp = s.add_parser("deploy", help="create the workload on your worker and wait until it serves")
    dp.add_argument("--worker-id", default=None, help="your registered worker (default: $IK_WORKER_ID)")
    dp.add_argument("--project", default=None, help="project (default: $INFERENCEKEY_PROJECT)")
    dp.add_argument("--slug", default=None, help="the workload's slug (default: the backend's slug)")
    dp.add_argument("--base-url", default=None, help="control plane (default: $INFERENCEKEY_BASE_URL)")
    dp.set_defaults(func=run_deploy)
    sv = s.add_parser("serve", help="run the backend here through the SDK's runtime, as a worker does")
    sv.add_argument("--port", type=int, default=8099, help="loopback port of the runtime (default 8099)")
    sv.set_defaults(func=run_serve)
    p.set_defaults(func=lambda args, ctx: (p.print_help(), ExitCode.USAGE)[1])


def _sdk_missing() -> str | None:
    try:
        import inferencekey  # noqa: F401
    except ImportError:
        return ("The InferenceKey SDK is not installed: pip install 'dsv41-panel[inferencekey]' (or "
                "`pip install inferencekey`), then run this again.")
    return None


def _guard() -> int | None:
    missing = _sdk_missing()
    if missing:
        print(f"dsv41 inferencekey: {missing}", file=sys.stderr)
        return ExitCode.FAIL
    return None


def run_package(args, ctx) -> int:
    if (rc := _guard()) is not None:
        return rc
    from ..inferencekey.artifact import package

    pkg = package(Path(args.out))
    with tarfile.open(pkg.path, "r:gz") as tar:
        n = len(tar.getnames())
    print(f"artifact: {pkg.path}")
    print(f"  {n} files, {pkg.size_bytes:,} bytes ({pkg.size_bytes / 1024:,.0f} KiB), sha256 {pkg.sha256}")
    print(f"  slug {pkg.manifest['slug']}, task type {pkg.manifest['task_type']}, entrypoint "
          f"{pkg.manifest['entrypoint']}")
    return ExitCode.OK


def run_publish(args, ctx) -> int:
    if (rc := _guard()) is not None:
        return rc
    import tempfile

    from ..inferencekey.artifact import TENANT_ENV, control_token, package, publish

    token = control_token()
    tenant = args.tenant or os.environ.get(TENANT_ENV, "")
    with tempfile.TemporaryDirectory(prefix="dsv41-ik-") as tmp:
        path = args.package or package(Path(tmp)).path
        rec = publish(path, tenant=tenant, token=token, base_url=args.base_url)
    print(f"published: {rec.get('slug')} (id {rec.get('id')}, sha256 {rec.get('sha256')})")
    print("next: `dsv41 inferencekey deploy --worker-id wrk_…` pins it to your worker")
    return ExitCode.OK


def run_deploy(args, ctx) -> int:
    if (rc := _guard()) is not None:
        return rc
    from ..inferencekey import SLUG
    from ..inferencekey.artifact import DeployOptions, control_token, deploy, workload_spec

    spec = workload_spec(args.worker_id or os.environ.get("IK_WORKER_ID", ""), workload_slug=args.slug or SLUG,
                         project=args.project or os.environ.get("INFERENCEKEY_PROJECT") or None)
    ref = deploy(spec, token=control_token(), options=DeployOptions.from_env(), base_url=args.base_url)
    base = (args.base_url or os.environ.get("INFERENCEKEY_BASE_URL") or "https://api.inferencekey.com").rstrip("/")
    print(f"ready: {base}/endpoint/{ref.project_slug}/{ref.workload_slug}/v1 (model \"default\"; an ik_live_ key "
          "from the dashboard calls it)")
    return ExitCode.OK


def run_serve(args, ctx) -> int:
    if (rc := _guard()) is not None:
        return rc
    from inferencekey.backend.serve import main as serve_main

    from ..inferencekey import ENTRYPOINT

    return serve_main(["--port", str(args.port), "--backend", ENTRYPOINT])
