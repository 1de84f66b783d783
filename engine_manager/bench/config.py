"""What a bench run compares: a configuration (:class:`BenchConfig`: settings, hot-set size, llama.cpp's layers in
RAM), the baseline, the guides' A/B presets and their published effect on one user (:func:`guide_effect`), and the
CLI's ``--config`` parser. Below both the runner and the result document."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import UserError
from ..metrics.guides import GUIDE_TABLE, GUIDE_UNBOUND_1_USER

# The guides' figure for each preset's effect on one user (docs/ENGINE_CONTRACT.md §1): --cpu-numerics gpu costs 25.7%,
# no NUMA binding ~53 instead of 63.11 tok/s.
GUIDE_EFFECT = {"cpu_numerics=gpu": 1 - 0.257, "numa_binding=off": GUIDE_UNBOUND_1_USER / GUIDE_TABLE[1][0]}


@dataclass
class BenchConfig:
    name: str
    label: str = ""
    settings: dict[str, Any] = field(default_factory=dict)     # Settings field → value
    expert_cache: int | str | None = None                      # hot-set size in experts, or "half"
    cpu_layers: list[int] | str | None = None                  # llama.cpp: "half" | "all" | "none" | layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchConfig":
        return cls(**{k: d[k] for k in ("name", "label", "settings", "expert_cache", "cpu_layers") if k in d})

    def effect_key(self) -> str | None:
        for k, v in self.settings.items():
            key = f"{k}={v}"
            if key in GUIDE_EFFECT:
                return key
        return None


BASELINE = BenchConfig("baseline", "baseline (your settings)")

# What the baseline sets for each preset (its A side); the preset's configuration is the B side
PRESET_BASELINE: dict[str, dict[str, Any]] = {"numerics": {"cpu_numerics": "fork"}, "numa": {"numa_binding": "auto"},
                                              "hotset": {}, "placement": {}}
# The guides' three settings, plus llama.cpp's placement
PRESETS: dict[str, list[BenchConfig]] = {
    "numerics": [BenchConfig("numerics_gpu", "--cpu-numerics gpu", {"cpu_numerics": "gpu"})],
    "numa": [BenchConfig("numa_off", "NUMA binding off", {"numa_binding": "off"})],
    "hotset": [BenchConfig("hotset_half", "hot set halved", expert_cache="half")],
    "placement": [BenchConfig("half_in_ram", "half the MoE layers' experts in RAM", cpu_layers="half")],
}
PRESET_WORDS = {"numerics": "CPU numerics: fork vs gpu (the guides: gpu costs 25.7% at 1 user)",
                "numa": "NUMA binding: auto vs off (the guides: ~53 → 63 tok/s at 1 user)",
                "hotset": "Hot set: the plan's vs half of it (the guides: ~9 in 10 picks on the GPU)",
                "placement": "llama.cpp: all experts on the GPU vs half of the MoE layers in RAM"}


def parse_config(text: str) -> BenchConfig:
    """``NAME:key=value,key=value`` (keys: Settings fields, ``expert_cache``, ``cpu_layers``) — the CLI's
    ``--config``. Plain-words :class:`UserError` on a bad one."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name or not rest:
        raise UserError(f"bad --config {text!r}: write NAME:key=value[,key=value], e.g. gpu_num:cpu_numerics=gpu")
    cfg = BenchConfig(name, name)
    for part in rest.split(","):
        k, eq, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or not k:
            raise UserError(f"bad --config {text!r}: {part!r} is not key=value")
        if k == "expert_cache":
            cfg.expert_cache = v if v == "half" else _int(v, text)
        elif k == "cpu_layers":
            cfg.cpu_layers = v if v in ("half", "all", "none") else [_int(x, text) for x in v.split("+") if x]
        else:
            cfg.settings[k] = _int(v, text) if v.isdigit() else v
    return cfg


def _int(v: str, text: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise UserError(f"bad --config {text!r}: {v!r} is not a whole number") from None


def guide_effect(cfg: BenchConfig) -> float | None:
    key = cfg.effect_key()
    return GUIDE_EFFECT.get(key) if key else None
