"""Bind the engine to the GPU's NUMA node — with a binding that has been seen to work on this machine.

Strategies, strongest first: ``numactl --cpunodebind=N --preferred=N`` (CPU threads and, where it fits, memory on
node N; the guides' measured gain: benchmarks/results/design_figures.md); ``numactl --cpunodebind=N`` (CPUs only;
memory follows first touch); ``taskset -c <CPUs of N>`` (no libnuma, or its memory-policy calls refused); none.
Each is **probed by really running it** (``<prefix> true``): a container whose seccomp profile refuses
``set_mempolicy``/``mbind`` makes numactl fail only when it runs, with a one-line "Operation not permitted" easy to
miss in an engine log. :func:`choose_binding` takes the first that exits 0 and says why each stronger one failed.
On a one-node host binding cannot change speed; the probe still runs, so the command is the one a two-socket machine
would get, and the report says so. ``python -m engine_manager.numa [--json]`` prints the decision for this machine
(under ``python -m engine_manager.numa_seccomp_probe``: what a container's filter does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

from .hardware import HardwareReport, NumaNodeInfo, format_cpulist, numa_nodes, parse_cpulist

PROBE_TIMEOUT_S = 5.0

STRATEGIES = ("numactl-preferred", "numactl-cpunodebind", "taskset", "none")

STRATEGY_WORDS = {
    "numactl-preferred": "CPU threads and memory on the node",
    "numactl-cpunodebind": "CPU threads on the node, memory not steered",
    "taskset": "CPU threads on the node by plain affinity, memory not steered",
    "none": "not bound",
}


@dataclass
class Strategy:
    name: str
    prefix: list[str]


@dataclass
class ProbeResult:
    """One strategy, probed: the command run, whether it worked, and if not why, in plain words."""

    strategy: str
    command: list[str]
    ok: bool
    returncode: int | None = None
    output: str = ""          # what the command printed (stderr + stdout, trimmed)
    reason: str = ""          # plain words when it failed

    @property
    def command_line(self) -> str:
        return " ".join(self.command)


@dataclass
class Binding:
    """The binding chosen for the engine and how it was chosen."""

    strategy: str                       # one of STRATEGIES
    prefix: list[str]                   # goes in front of the engine's argv (empty for none)
    node: int | None                    # the NUMA node bound to, None when unknown / not bound
    cpus: list[int] = field(default_factory=list)
    nodes_on_host: int = 1
    reason: str = ""                    # why this one (and why the stronger ones were not used)
    note: str | None = None             # e.g. one-node host: binding cannot matter
    attempts: list[ProbeResult] = field(default_factory=list)

    @property
    def bound(self) -> bool:
        return bool(self.prefix)

    @property
    def single_node(self) -> bool:
        return self.nodes_on_host <= 1

    def summary(self) -> str:
        """One line: ``numactl --cpunodebind=0 --preferred=0 (node 0, CPUs 0-1)`` or ``none (…)``."""
        if not self.prefix:
            return f"none — {self.reason_short().removeprefix('Not bound: ')}"
        cpus = f", CPUs {format_cpulist(self.cpus)}" if self.cpus else ""
        return f"{' '.join(_short(self.prefix))} (node {self.node}{cpus})"

    def reason_short(self) -> str:
        return self.reason.split(". ")[0].rstrip(".") if self.reason else "not bound"

    def describe(self) -> list[str]:
        """Lines for a person: the choice, why, each probe, and the one-node note."""
        if self.prefix:
            lines = [f"Binding: {self.summary()} — {STRATEGY_WORDS.get(self.strategy, self.strategy)}."]
        else:
            lines = ["Binding: none."]
        if self.reason and not self.attempts:
            lines.append(self.reason)
        for a in self.attempts:
            mark = "works" if a.ok else "refused"
            line = f"  probe: {a.command_line}  → {mark}"
            if not a.ok:
                line += f": {a.reason}"
            lines.append(line)
        if self.note:
            lines.append(self.note)
        return lines

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Binding":
        d = dict(d)
        d.pop("summary", None)
        d["attempts"] = [ProbeResult(**a) for a in d.get("attempts", [])]
        return cls(**d)


# -- what to bind to -----------------------------------------------------------------------------------------

@dataclass
class Target:
    node: int | None
    cpus: list[int]
    nodes: list[NumaNodeInfo]
    why_none: str = ""        # when node is None: why there is nothing to bind to


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def target_node(hardware: HardwareReport | None, gpu_index: int = 0) -> Target:
    """The node to bind to: the GPU's node, or the only node of a one-node host."""
    nodes = list(hardware.host.numa_nodes) if hardware is not None else numa_nodes()
    if not nodes:
        nodes = numa_nodes()
    gpu = hardware.gpu(gpu_index) if hardware is not None else None
    if hardware is not None and gpu is None and hardware.gpus:
        gpu = hardware.gpus[0]
    node: int | None = None
    why = ""
    if gpu is not None:
        if gpu.numa_node is not None and gpu.numa_node >= 0:
            node = gpu.numa_node
        elif len(nodes) == 1:
            node = nodes[0].id
        else:
            why = (f"the NUMA node of GPU {gpu.index} ({gpu.name}) is unknown (the driver and sysfs report -1, "
                   f"common in VMs and on boards that do not describe PCIe locality), and this host has "
                   f"{len(nodes)} nodes; binding to a guessed node could put the engine on the far socket and "
                   "make it slower than not binding. Check the NUMA Affinity column of `nvidia-smi topo -m`")
    elif len(nodes) == 1:
        node = nodes[0].id
    else:
        why = (f"there is no GPU to be near and this host has {len(nodes)} NUMA nodes; the engine is left "
               "to the kernel's scheduler")
    cpus: list[int] = []
    if node is not None:
        cpus = next((list(n.cpus) for n in nodes if n.id == node), [])
        allowed = _allowed_cpus()
        if allowed is not None and cpus:
            inside = [c for c in cpus if c in allowed]
            cpus = inside or cpus   # an empty intersection is reported by the probes failing
    return Target(node, cpus, nodes, why)


def strategies(node: int, cpus: list[int], which: Callable[[str], str | None] = shutil.which) -> list[Strategy]:
    """The candidate prefixes for ``node``, strongest first (``none`` last, always)."""
    out: list[Strategy] = []
    numactl = which("numactl") or "numactl"
    taskset = which("taskset") or "taskset"
    out.append(Strategy("numactl-preferred", [numactl, f"--cpunodebind={node}", f"--preferred={node}"]))
    out.append(Strategy("numactl-cpunodebind", [numactl, f"--cpunodebind={node}"]))
    if cpus:
        out.append(Strategy("taskset", [taskset, "-c", format_cpulist(cpus)]))
    out.append(Strategy("none", []))
    return out


def _short(prefix: list[str]) -> list[str]:
    """Show tools by their name, not their full path (``/usr/bin/numactl`` → ``numactl``)."""
    if prefix and os.path.isabs(prefix[0]):
        return [os.path.basename(prefix[0]), *prefix[1:]]
    return list(prefix)


def explain_failure(strategy: str, returncode: int | None, output: str, node: int) -> str:
    """Plain words for a failed probe, with what to do."""
    low = output.lower()
    tool = "numactl" if strategy.startswith("numactl") else "taskset"
    if returncode is None and "not found" in low:
        return (f"{tool} is not installed (install the `{'numactl' if tool == 'numactl' else 'util-linux'}` "
                "package)")
    if "set_mempolicy" in low or "setting preferred node" in low or "mbind" in low:
        return ("the kernel refused the memory policy call (set_mempolicy: Operation not permitted) — typically a "
                "container's seccomp filter; allow set_mempolicy/mbind (e.g. `--cap-add SYS_NICE`, or a seccomp "
                "profile that permits them) to get memory binding")
    if "does not support numa policy" in low or "no numa available" in low:
        return ("numactl says this system does not support NUMA policy — the memory-policy system calls are "
                "missing or blocked (a sandbox or container returning ENOSYS), so numactl cannot run at all")
    if "sched_setaffinity" in low or "affinity" in low:
        if "invalid argument" in low:
            return (f"the CPUs of node {node} are not allowed for this process (a cpuset or container CPU limit "
                    "excludes them)")
        return ("the kernel refused to set CPU affinity (sched_setaffinity: Operation not permitted) — a "
                "seccomp filter or security policy blocks it")
    if "invalid" in low or "not in" in low or "out of range" in low:
        return f"node {node} was rejected: {output.strip().splitlines()[-1] if output.strip() else 'invalid'}"
    if returncode is None:
        return f"the probe did not finish within {PROBE_TIMEOUT_S:.0f} s"
    last = output.strip().splitlines()[-1] if output.strip() else "no message"
    return f"exit code {returncode}: {last}"


def probe_strategy(strategy: Strategy, node: int, timeout_s: float = PROBE_TIMEOUT_S,
                   env: dict[str, str] | None = None) -> ProbeResult:
    """Run ``<prefix> true`` for real and report."""
    if not strategy.prefix:
        return ProbeResult(strategy.name, [], True, 0)
    true = shutil.which("true") or "true"
    cmd = [*strategy.prefix, true]
    shown = [*_short(strategy.prefix), "true"]
    try:
        cp = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            timeout=timeout_s, env=env, check=False)
    except FileNotFoundError:
        return ProbeResult(strategy.name, shown, False, None, f"{strategy.prefix[0]}: not found",
                           explain_failure(strategy.name, None, "not found", node))
    except subprocess.TimeoutExpired:
        return ProbeResult(strategy.name, shown, False, None, "timed out",
                           explain_failure(strategy.name, None, "", node))
    except OSError as exc:
        return ProbeResult(strategy.name, shown, False, None, str(exc),
                           explain_failure(strategy.name, None, str(exc), node))
    out = cp.stdout.decode("utf-8", "replace").strip()[-2000:]
    if cp.returncode == 0:
        return ProbeResult(strategy.name, shown, True, 0, out)
    return ProbeResult(strategy.name, shown, False, cp.returncode, out,
                       explain_failure(strategy.name, cp.returncode, out, node))


def one_node_note(nodes: list[NumaNodeInfo]) -> str:
    n = nodes[0]
    mem = f", {n.mem_total_bytes / 1024**3:.1f} GiB" if n.mem_total_bytes else ""
    cpus = format_cpulist(n.cpus) if n.cpus else "all CPUs"
    return (f"This host has one NUMA node (node {n.id}: CPUs {cpus}{mem}), so binding cannot change speed: every "
            "CPU and all of memory are equally near the GPU. The binding is probed and applied anyway so the "
            "command is the one a multi-socket host would get; it costs nothing here.")


def choose_binding(hardware: HardwareReport | None = None, gpu_index: int = 0, mode: str = "auto",
                   *, env: dict[str, str] | None = None,
                   which: Callable[[str], str | None] | None = None) -> Binding:
    """Probe the strategies in order and return the first that works (``none`` at worst)."""
    target = target_node(hardware, gpu_index)
    n_nodes = len(target.nodes)
    note = one_node_note(target.nodes) if n_nodes == 1 else None
    if mode == "off":
        return Binding("none", [], None, [], n_nodes,
                       "Binding is turned off in the settings (numa_binding = off, DSV41_NUMA=off).", note)
    if target.node is None:
        return Binding("none", [], None, [], n_nodes, f"Not bound: {target.why_none}.", note)
    if which is None:
        if env is not None and "PATH" in env:
            def which(name: str) -> str | None:  # noqa: E306 - resolve tools on the PATH the probe will use
                return shutil.which(name, path=env["PATH"])
        else:
            which = shutil.which
    attempts: list[ProbeResult] = []
    for strat in strategies(target.node, target.cpus, which):
        res = probe_strategy(strat, target.node, env=env)
        if strat.name == "none":
            break
        attempts.append(res)
        if res.ok:
            return Binding(strat.name, list(strat.prefix), target.node, target.cpus, n_nodes,
                           _reason(strat.name, attempts), note, attempts)
    return Binding("none", [], target.node, target.cpus, n_nodes, _reason("none", attempts), note, attempts)


def _reason(chosen: str, attempts: list[ProbeResult]) -> str:
    failed = [a for a in attempts if not a.ok]
    if chosen == "numactl-preferred":
        return "The strongest binding works here: CPU threads and memory both on the GPU's node."
    head = {
        "numactl-cpunodebind": "Bound by CPUs only (numactl --cpunodebind)",
        "taskset": "Bound by CPU affinity only (taskset)",
        "none": "Not bound: every binding was refused",
    }[chosen]
    why = "; ".join(f"`{a.command_line}` failed: {a.reason}" for a in failed)
    return f"{head}. {why}." if why else f"{head}."


# -- a binding as front ends get it (a Binding, its dict, its one-line summary) ---------------------------

def binding_cpus(binding: Any) -> list[int] | None:
    """The CPU list of a binding, however it is given: a ``numa.Binding`` (``.cpus``), its dict, a cpulist
    string ``"0-7,16"``, a list of ints; None when unknown or unbound."""
    if binding is None:
        return None
    if isinstance(binding, Mapping):
        cpus = binding.get("cpus")
        if binding.get("prefix") == []:
            return None
    elif isinstance(binding, str):
        # a cpulist ("0-7,16") or the supervisor's one-line summary ("numactl … (node 0, CPUs 0-7)")
        if binding.strip().lower().startswith("none"):
            return None
        m = re.search(r"CPUs ([\d,\-]+)", binding)
        text = m.group(1) if m else binding
        try:
            return parse_cpulist(text) or None
        except ValueError:
            return None
    elif isinstance(binding, (list, tuple)):
        cpus = list(binding)
    else:
        if getattr(binding, "prefix", None) == []:
            return None
        cpus = getattr(binding, "cpus", None)
    if isinstance(cpus, str):
        try:
            return parse_cpulist(cpus) or None
        except ValueError:
            return None
    try:
        return [int(c) for c in cpus] if cpus else None
    except (TypeError, ValueError):
        return None


def binding_bound(binding: Any) -> bool | None:
    """True when the engine runs behind a binding prefix, False when explicitly unbound, None when unknown."""
    if binding is None:
        return None
    if isinstance(binding, str):
        return not binding.strip().lower().startswith("none")
    if isinstance(binding, Mapping):
        if "prefix" in binding:
            return bool(binding["prefix"])
        return None
    prefix = getattr(binding, "prefix", None)
    if prefix is not None:
        return bool(prefix)
    return None


# -- command line ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine_manager.numa",
                                description="Probe the NUMA binding strategies on this machine and print the "
                                            "one the engine would get.")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.add_argument("--gpu", type=int, default=0, help="GPU index (NVML) to bind near")
    p.add_argument("--no-gpu-probe", action="store_true", help="skip NVML; use the host's nodes only")
    args = p.parse_args(argv)
    report = None
    if not args.no_gpu_probe:
        from .hardware import probe
        report = probe()
    b = choose_binding(report, args.gpu)
    if args.json:
        json.dump(b.to_dict(), sys.stdout, indent=2)
        print()
    else:
        print("\n".join(b.describe()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
