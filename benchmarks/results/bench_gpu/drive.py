"""``dsv41 bench`` alone (no other sub-command imported): what run_gpu.sh runs on the GPU machine."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine_manager.cli import Context  # noqa: E402
from engine_manager.cli import bench  # noqa: E402

parser = argparse.ArgumentParser(prog="dsv41")
bench.register(parser.add_subparsers())
args = parser.parse_args(["bench"] + sys.argv[1:])
sys.exit(args.func(args, Context()))
