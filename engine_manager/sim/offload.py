"""The scripted engine's offload model: routing, the VRAM hot set, the adaptive tier and the cost of a token.

Everything here is a *stated model*, not a measurement, tuned so that the guides' reference layout (40 MoE layers
× 384 experts, 6 used, the 5,825 most used in VRAM) reproduces the guides' published figures (about 9 in 10 picks
on the GPU; 63.11 tok/s for 1 user, 152.53 total for 8). The model, its parameters and how they were fitted:
benchmarks/results/sim_engine.md.

* Routing: per layer a seeded Zipf–Mandelbrot popularity (``--skew``); a token's ``k`` experts per layer are drawn
  by systematic PPS sampling, so the expected frequency table is exact (:func:`expected_frequencies`).
* Topics (``corpus.py``) move ``TOPIC_DRIFT`` of each layer's favourites, so a change of topic makes the adaptive
  tier swap experts in, with hysteresis like Strata's ``--adapt-every/--adapt-swaps/--adapt-decay``.
* Cost of a decode step of ``B`` tokens: a fixed and per-token GPU cost, the hot experts read from VRAM, the
  missed ones from RAM by the CPU, and the swaps over PCIe (:class:`CostModel`, :func:`modelled_throughput`);
  prefill is the cheaper of the batched step and streaming every cold expert over PCIe once.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..fmt import MIB


# -- the guides' reference layout (docs/ENGINE_CONTRACT.md §1) --------------------------------------------------------
REF_MOE_LAYERS = 40
REF_N_EXPERTS = 384
REF_EXPERTS_USED = 6
REF_HOT = 5825
REF_EXPERT_BYTES = int(round(12.2 * MIB))   # 12,792,627 bytes
REF_FIRST_MOE_LAYER = 3                      # DeepSeek-style: the first layers are dense
REF_MAX_CONTEXT = 32768

N_PERMS = 16            # orderings per layer used by the systematic sampler
DEFAULT_SEED = 41
N_TOPICS = 5            # routing distributions: one per topic of the corpus (engine_manager/sim/corpus.py)
TOPIC_DRIFT = 0.25      # share of a layer's favourites that another topic routes elsewhere


# ------------------------------------------------------------------------------------------------ distribution
@dataclass(frozen=True)
class Skew:
    """A named routing skew. ``target`` (0..1) solves the exponent so that the best ``hot_fraction`` of all
    pairs carry ``target`` of the lookups; otherwise ``exponent`` is used as given."""

    name: str
    offset: float = 8.0
    spread: float = 0.15
    target: float | None = 0.90
    hot_fraction: float = REF_HOT / (REF_MOE_LAYERS * REF_N_EXPERTS)
    exponent: float | None = None


SKEWS = {
    "reference": Skew("reference", target=0.90),
    "mild": Skew("mild", target=0.75),
    "steep": Skew("steep", target=0.97),
    "flat": Skew("flat", target=None, exponent=0.0, spread=0.0),
}


def parse_skew(text: str) -> Skew:
    """``reference`` | ``mild`` | ``steep`` | ``flat`` | ``zm:S`` | ``zm:S,Q`` (Zipf–Mandelbrot exponent S,
    offset Q)."""
    t = (text or "reference").strip().lower()
    if t in SKEWS:
        return SKEWS[t]
    if t.startswith("zm:"):
        parts = t[3:].split(",")
        try:
            s = float(parts[0])
            q = float(parts[1]) if len(parts) > 1 else 8.0
        except (ValueError, IndexError):
            raise ValueError(f"bad skew {text!r}: write zm:EXPONENT[,OFFSET], e.g. zm:1.4,8") from None
        if not (0 <= s <= 10 and 0 < q <= 1000):
            raise ValueError(f"bad skew {text!r}: exponent must be 0..10 and offset 0..1000")
        return Skew(t, offset=q, target=None, exponent=s)
    raise ValueError(f"unknown skew {text!r}: choose reference, mild, steep, flat or zm:EXPONENT[,OFFSET]")


def _inclusion(weights: np.ndarray, k: int) -> np.ndarray:
    """π = min(1, c·w) with Σπ = k (k ≤ number of experts)."""
    p = weights / weights.sum() * k
    for _ in range(64):
        over = p > 1.0
        if not over.any():
            break
        p[over] = 1.0
        rest = ~over
        p[rest] = p[rest] / p[rest].sum() * (k - int(over.sum()))
    return np.minimum(p, 1.0)


def _layer_pis(n_layers: int, n_experts: int, k: int, exponent: float, offset: float,
               spreads: np.ndarray) -> np.ndarray:
    ranks = np.arange(n_experts, dtype=np.float64)
    out = np.empty((n_layers, n_experts))
    for l in range(n_layers):
        s = exponent * (1.0 + spreads[l])
        out[l] = _inclusion((ranks + offset) ** -s, k)
    return out


def _top_share(pis_by_rank: np.ndarray, n_hot: int, k: int) -> float:
    flat = np.sort(pis_by_rank.ravel())[::-1]
    n_layers = pis_by_rank.shape[0]
    return float(flat[:n_hot].sum() / (n_layers * k))


def expected_frequencies(n_layers: int = REF_MOE_LAYERS, n_experts: int = REF_N_EXPERTS,
                         k: int = REF_EXPERTS_USED, skew: str | Skew = "reference",
                         seed: int = DEFAULT_SEED) -> np.ndarray:
    """The sim's routing distribution as an ``(n_layers, n_experts)`` array of inclusion probabilities
    π[l, e] = P(a decoded token routes to expert e in MoE layer l) (each row sums to ``k``).

    Dividing by ``n_layers·k`` gives the expected share of all expert lookups per pair — the frequency table a
    planner ranks by; ``predicted_hit_rate(pi, hot_pairs)`` is then the expected GPU hit rate of a hot set.
    Rows are indexed by MoE-layer *position* (0..n_layers-1), not by model layer number."""
    return RoutingDistribution(n_layers, n_experts, k, skew, seed).pi.copy()


def predicted_hit_rate(pi: np.ndarray, hot_pairs: Iterable[tuple[int, int]]) -> float:
    """Expected share of lookups that hit a hot set given as (layer position, expert) pairs."""
    mask = np.zeros(pi.shape, dtype=bool)
    for l, e in hot_pairs:
        mask[l, e] = True
    return float(pi[mask].sum() / pi.sum())


class RoutingDistribution:
    """Per-layer skewed routing with exact inclusion probabilities (see the module docstring)."""

    def __init__(self, n_layers: int, n_experts: int, k: int, skew: str | Skew = "reference",
                 seed: int = DEFAULT_SEED, routing_seed: int | None = None, topics: int = 1,
                 drift: float = TOPIC_DRIFT):
        if not (1 <= k <= n_experts):
            raise ValueError(f"experts used per token ({k}) must be 1..{n_experts}")
        self.n_layers, self.n_experts, self.k = n_layers, n_experts, k
        self.skew = parse_skew(skew) if isinstance(skew, str) else skew
        rng = np.random.default_rng(seed)
        spreads = rng.uniform(-self.skew.spread, self.skew.spread, n_layers) if self.skew.spread else \
            np.zeros(n_layers)
        self.exponent = self._solve_exponent(spreads) if self.skew.exponent is None else self.skew.exponent
        by_rank = _layer_pis(n_layers, n_experts, k, self.exponent, self.skew.offset, spreads)
        # rank -> expert id, per layer
        self.rank_to_expert = np.stack([rng.permutation(n_experts) for _ in range(n_layers)])
        self.pi = np.empty_like(by_rank)
        for l in range(n_layers):
            self.pi[l, self.rank_to_expert[l]] = by_rank[l]
        # orderings for the systematic sampler, and the cumulative sums along each ordering, laid out as one
        # increasing array: row (l, m) is offset by (l·N_PERMS + m)·(k + 1)
        self.perms = np.stack([np.stack([rng.permutation(n_experts) for _ in range(N_PERMS)])
                               for _ in range(n_layers)])                     # (L, M, E)
        offsets = (np.arange(n_layers * N_PERMS, dtype=np.float64) * (k + 1)).reshape(n_layers, N_PERMS, 1)
        self._row_offsets = offsets.reshape(n_layers, N_PERMS)
        # topics: topic 0 is the distribution above; topic t > 0 moves a share (``drift``) of each layer's
        # favourites (the ranks a hot set of the reference share holds) to experts ranked just below them, and
        # those experts up in their place (seeded by ``seed`` and t), so a change of topic changes which experts
        # are worth holding in VRAM
        self.n_topics = max(1, int(topics))
        self.drift = float(drift)
        self.topic_pi = [self.pi]
        band = max(1, int(round(self.skew.hot_fraction * n_experts)))
        for t in range(1, self.n_topics):
            trng = np.random.default_rng([seed, t])
            r2e = self.rank_to_expert.copy()
            n_move = min(int(round(self.drift * band)), max(0, n_experts - band))
            for l in range(n_layers):
                if n_move <= 0:
                    break
                up = trng.choice(np.arange(band, min(n_experts, 3 * band)), n_move, replace=False)
                down = trng.choice(np.arange(band), n_move, replace=False)
                r2e[l, up], r2e[l, down] = r2e[l, down].copy(), r2e[l, up].copy()
            pi_t = np.empty_like(by_rank)
            for l in range(n_layers):
                pi_t[l, r2e[l]] = by_rank[l]
            self.topic_pi.append(pi_t)
        self._flat_cums = [self._cums(p, offsets) for p in self.topic_pi]
        # the draws: fresh each run unless fixed (the *distribution* above is fixed by ``seed``)
        self._rng = np.random.default_rng(routing_seed)

    def _cums(self, pi: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        ordered = np.take_along_axis(np.repeat(pi[:, None, :], N_PERMS, axis=1), self.perms, axis=2)
        cums = np.cumsum(ordered, axis=2)
        cums[:, :, -1] = self.k + 1e-9     # guard against rounding at the row's end
        return (cums + offsets).ravel()

    def _solve_exponent(self, spreads: np.ndarray) -> float:
        sk = self.skew
        n_hot = max(1, int(round(sk.hot_fraction * self.n_layers * self.n_experts)))
        lo, hi = 0.0, 8.0
        ranks = np.arange(self.n_experts, dtype=np.float64)

        def share(s: float) -> float:
            pis = np.stack([_inclusion((ranks + sk.offset) ** -(s * (1 + d)), self.k) for d in spreads])
            return _top_share(pis, n_hot, self.k)

        if share(hi) < (sk.target or 0):
            return hi
        for _ in range(40):
            mid = (lo + hi) / 2
            if share(mid) < (sk.target or 0):
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def topic(self, t: int | None) -> int:
        """A topic number folded into this distribution's topics (None: topic 0)."""
        return int(t or 0) % self.n_topics

    def sample_mixed(self, topics: list[int | None]) -> np.ndarray:
        """Experts for one token per entry of ``topics`` (each drawn from its topic's distribution), in order:
        ``(len(topics), n_layers, k)``."""
        folded = [self.topic(t) for t in topics]
        if len(set(folded)) <= 1:
            return self.sample(len(folded), folded[0] if folded else 0)
        out = np.empty((len(folded), self.n_layers, self.k), dtype=np.int64)
        for t in sorted(set(folded)):
            rows = [i for i, x in enumerate(folded) if x == t]
            out[rows] = self.sample(len(rows), t)
        return out

    def sample(self, n_tokens: int, topic: int = 0) -> np.ndarray:
        """Experts for ``n_tokens`` tokens of ``topic``: an int array ``(n_tokens, n_layers, k)`` of distinct
        expert ids per (token, layer)."""
        flat_cums = self._flat_cums[self.topic(topic)]
        L, M, k = self.n_layers, N_PERMS, self.k
        m = self._rng.integers(0, M, size=(n_tokens, L))
        u = self._rng.random((n_tokens, L))
        base = self._row_offsets[np.arange(L)[None, :], m]                      # (T, L)
        thresholds = (base + u)[:, :, None] + np.arange(k)[None, None, :]       # (T, L, k)
        pos = np.searchsorted(flat_cums, thresholds.ravel(), side="right")
        row_start = ((np.arange(L)[None, :] * M + m) * self.n_experts)[:, :, None]
        idx = np.clip(pos.reshape(n_tokens, L, k) - row_start, 0, self.n_experts - 1)
        layer_ix = np.broadcast_to(np.arange(L)[None, :, None], idx.shape)
        m_ix = np.broadcast_to(m[:, :, None], idx.shape)
        return self.perms[layer_ix, m_ix, idx]

    def gate_weights(self, experts: np.ndarray, topics: list[int | None] | None = None) -> np.ndarray:
        """Plausible router weights for a trace: proportional to the token's topic's π, normalised per
        (token, layer)."""
        L = self.n_layers
        if topics is None or self.n_topics == 1:
            w = self.pi[np.arange(L)[None, :, None], experts].astype(np.float32)
        else:
            stack = np.stack(self.topic_pi)                                       # (T, L, E)
            tix = np.asarray([self.topic(t) for t in topics])[:, None, None]
            w = stack[tix, np.arange(L)[None, :, None], experts].astype(np.float32)
        return w / w.sum(axis=2, keepdims=True)

    def ideal_hot(self, n_hot: int) -> np.ndarray:
        """The best hot set of ``n_hot`` pairs for this distribution: a boolean ``(L, E)`` mask."""
        flat = self.pi.ravel()
        order = np.argsort(-flat, kind="stable")[:n_hot]
        mask = np.zeros(flat.size, dtype=bool)
        mask[order] = True
        return mask.reshape(self.pi.shape)

    def expected_hit_rate(self, hot: np.ndarray) -> float:
        return float(self.pi[hot].sum() / (self.n_layers * self.k))


# ------------------------------------------------------------------------------------------------ cost model
@dataclass(frozen=True)
class CostModel:
    """The stated cost of a decode step and of reading a prompt (see the module docstring)."""

    t0_s: float = 10.02e-3            # fixed GPU time per step (attention/dense weights, launches, sync)
    tg_s: float = 1.218e-3            # GPU time per decoded token in the step (attention over its KV, etc.)
    tp_s: float = 0.0606e-3           # GPU time per prompt token when reading a prompt (batched)
    vram_Bps: float = 1.8e12          # VRAM bandwidth for hot experts' weights
    cpu_Bps: float = 128e9            # host RAM bandwidth the CPU expert pool achieves (NUMA-bound)
    t_row_s: float = 25e-6            # CPU compute per (token, missed expert)
    pcie_Bps: float = 30.2e9          # host→VRAM copies (adaptive-tier swaps, prompt streaming)
    unbound_factor: float = 2.0       # CPU expert time without NUMA binding (remote-node RAM)
    gpu_numerics_factor: float = 2.83  # CPU expert time with --cpu-numerics gpu (bit-identical batches)

    def step_parts(self, b: int, u_hot: float, u_cold: float, misses: float, swaps: int, expert_bytes: int,
                   cpu_factor: float = 1.0) -> tuple[float, float, float]:
        """(GPU, CPU, PCIe-swap) seconds of one step; they add up (the model does not overlap them)."""
        gpu = self.t0_s + b * self.tg_s + u_hot * expert_bytes / self.vram_Bps
        cpu = cpu_factor * (u_cold * expert_bytes / self.cpu_Bps + misses * self.t_row_s)
        return gpu, cpu, swaps * expert_bytes / self.pcie_Bps

    def step_s(self, b: int, u_hot: float, u_cold: float, misses: float, swaps: int, expert_bytes: int,
               cpu_factor: float = 1.0) -> float:
        return sum(self.step_parts(b, u_hot, u_cold, misses, swaps, expert_bytes, cpu_factor))


def expected_distinct(pi_flat: np.ndarray, b: float) -> float:
    """Expected distinct pairs touched by ``b`` independent tokens: Σ 1 − (1 − π)^b."""
    if b <= 0 or pi_flat.size == 0:
        return 0.0
    return float((1.0 - np.power(1.0 - np.clip(pi_flat, 0, 1), b)).sum())


# ------------------------------------------------------------------------------------------------ STRP
def read_strp(path: str | Path) -> tuple[int, int, int, list[tuple[int, int]]]:
    """(n_layers, n_experts, slots, ranked pairs) from a Strata expert profile (docs/ENGINE_CONTRACT.md §2)."""
    data = Path(path).read_bytes()
    if len(data) < 24 or data[:4] != b"STRP":
        raise ValueError(f"{path}: not a Strata expert profile (no STRP magic)")
    version, n_layers, n_experts, slots, n_ranked = struct.unpack_from("<5I", data, 4)
    if version != 1:
        raise ValueError(f"{path}: STRP version {version} is not supported (expected 1)")
    need = 24 + 4 * n_ranked + 4 * n_layers * n_experts
    if n_layers > 4096 or n_experts > 65536 or n_ranked > n_layers * n_experts or len(data) < need:
        raise ValueError(f"{path}: truncated or inconsistent STRP profile")
    pairs = np.frombuffer(data, dtype="<u2", count=2 * n_ranked, offset=24).reshape(-1, 2)
    return n_layers, n_experts, slots, [(int(a), int(b)) for a, b in pairs]


def trace_record(layer: int, experts: np.ndarray, weights: np.ndarray) -> bytes:
    """One ``--dump-routing`` record: int32 layer, int32 k, k int32 ids, k float32 weights (little-endian)."""
    k = len(experts)
    return (struct.pack("<ii", layer, k) + np.asarray(experts, "<i4").tobytes()
            + np.asarray(weights, "<f4").tobytes())


# ------------------------------------------------------------------------------------------------ the model
@dataclass
class Layout:
    """What the sim takes from the plan."""

    moe_layers: list[int]
    n_experts: int
    k: int
    expert_bytes: int
    n_hot: int
    n_layers_total: int
    hot_set: list[tuple[int, int]] = field(default_factory=list)    # model layer numbers
    max_context: int = REF_MAX_CONTEXT
    slots: int = 1
    kv_type: str = "int8"
    model_name: str = "DeepSeek-V4.1-Flash"
    vram_total_bytes: int | None = None
    vram_used_bytes: int | None = None
    ram_used_bytes: int | None = None
    ram_total_bytes: int | None = None
    predicted_hit_rate: float | None = None
    refused: str | None = None
    hot_set_informed: bool = False      # the plan ranked its hot set from routing data (else the order is arbitrary)

    @property
    def n_moe(self) -> int:
        return len(self.moe_layers)

    @classmethod
    def reference(cls) -> "Layout":
        return cls(moe_layers=list(range(REF_FIRST_MOE_LAYER, REF_FIRST_MOE_LAYER + REF_MOE_LAYERS)),
                   n_experts=REF_N_EXPERTS, k=REF_EXPERTS_USED, expert_bytes=REF_EXPERT_BYTES, n_hot=REF_HOT,
                   n_layers_total=REF_FIRST_MOE_LAYER + REF_MOE_LAYERS)

    @classmethod
    def from_plan(cls, plan: dict[str, Any]) -> "Layout":
        ref = cls.reference()
        model = plan.get("model") or {}
        n_experts = int(model.get("n_experts") or ref.n_experts)
        moe = [int(x) for x in (model.get("moe_layers") or [])]
        if not moe:
            n_moe = int(model.get("n_moe_layers") or ref.n_moe)
            first = int(model.get("n_layers") or ref.n_layers_total) - n_moe
            moe = list(range(max(0, first), max(0, first) + n_moe))
        settings = plan.get("settings") or {}
        vram, ram = plan.get("vram") or {}, plan.get("ram") or {}
        hot_set = [(int(p[0]), int(p[1])) for p in (plan.get("hot_set") or [])]
        n_hot = plan.get("hot_experts")
        return cls(
            moe_layers=moe,
            n_experts=n_experts,
            k=int(model.get("n_experts_used") or ref.k),
            expert_bytes=int(model.get("expert_bytes") or ref.expert_bytes),
            n_hot=int(n_hot if n_hot is not None else (len(hot_set) or ref.n_hot)),
            n_layers_total=int(model.get("n_layers") or (max(moe) + 1)),
            hot_set=hot_set,
            max_context=int(settings.get("context_length") or ref.max_context),
            slots=int(settings.get("slots") or 1),
            kv_type=str(settings.get("kv_type") or "int8"),
            model_name=str(model.get("name") or ref.model_name),
            vram_total_bytes=vram.get("budget_bytes") or None,
            vram_used_bytes=vram.get("total_bytes") or None,
            ram_total_bytes=ram.get("budget_bytes") or None,
            ram_used_bytes=ram.get("total_bytes") or None,
            predicted_hit_rate=plan.get("predicted_hit_rate"),
            refused=plan.get("refused"),
            hot_set_informed=bool(hot_set) and (plan.get("predicted_hit_rate") is not None
                                                or bool((plan.get("usage") or {}).get("sources"))
                                                or bool(plan.get("strp_path"))),
        )


@dataclass
class StepResult:
    """What one shared decode step did."""

    duration_s: float                 # modelled
    hits: np.ndarray                  # per token: GPU hits among its L·k lookups
    lookups: int                      # per token
    swaps: int
    swap_bytes: int
    adapt_round: int | None           # the adaptive round number when the tier ran this step
    experts: np.ndarray | None = None  # (B, L, k) when the trace is wanted
    gpu_s: float = 0.0                # of duration_s: the GPU's part (for the utilisation figure)


class OffloadModel:
    """Routing draws, hot set, adaptive tier and costs for one running sim."""

    def __init__(self, layout: Layout, skew: str | Skew = "reference", seed: int = DEFAULT_SEED,
                 cost: CostModel | None = None, initial_hot: str = "auto", profile_pairs=None,
                 adapt_every: int = 4, adapt_swaps: int = 96, adapt_decay: float = 0.7, min_gain: float = 3.0,
                 noise_z: float = 2.0,
                 cpu_numerics: str = "fork", numa_bound: bool = True, routing_seed: int | None = None,
                 topics: int = 1, drift: float = TOPIC_DRIFT):
        self.layout = layout
        self.dist = RoutingDistribution(layout.n_moe, layout.n_experts, layout.k, skew, seed, routing_seed,
                                        topics=topics, drift=drift)
        self.cost = cost or CostModel()
        L, E = layout.n_moe, layout.n_experts
        self.n_hot = max(0, min(layout.n_hot, L * E))
        self.layer_pos = {lid: i for i, lid in enumerate(layout.moe_layers)}
        self.hot = self._initial_hot(initial_hot, profile_pairs, seed)
        self.counts = np.zeros((L, E), dtype=np.float64)
        self.adapt_every, self.adapt_swaps = max(0, adapt_every), max(0, adapt_swaps)
        self.adapt_decay, self.min_gain, self.noise_z = adapt_decay, min_gain, noise_z
        self.cpu_factor = (self.cost.gpu_numerics_factor if cpu_numerics == "gpu" else 1.0) * \
            (1.0 if numa_bound else self.cost.unbound_factor)
        self.steps = 0
        self.rounds = 0
        self.swaps_total = 0
        self.swap_bytes_total = 0
        self.lookups_total = 0
        self.hits_total = 0

    # -- hot set -----------------------------------------------------------------------------------------------
    def _initial_hot(self, how: str, profile_pairs, seed: int) -> np.ndarray:
        L, E = self.layout.n_moe, self.layout.n_experts
        mask = np.zeros((L, E), dtype=bool)
        if profile_pairs:
            pairs = list(profile_pairs)
        else:
            pairs = list(self.layout.hot_set)
            if how == "auto" and not self.layout.hot_set_informed:
                pairs = []       # a plan made without routing data orders its hot set arbitrarily
        if how == "auto":
            how = "plan" if pairs else "ideal"
        self.initial_hot_source = {"plan": "the plan's hot set" if not profile_pairs else "the expert profile",
                                   "ideal": "the shipped profile (the routing distribution's best experts)",
                                   "random": "a random pick"}.get(how, how)
        if how == "plan" and pairs:
            n = 0
            for lid, e in pairs:
                pos = self.layer_pos.get(lid)
                if pos is None or not (0 <= e < E) or mask[pos, e]:
                    continue
                mask[pos, e] = True
                n += 1
                if n >= self.n_hot:
                    break
            return mask
        if how == "random":
            rng = np.random.default_rng(seed + 7)
            flat = np.zeros(L * E, dtype=bool)
            flat[rng.choice(L * E, self.n_hot, replace=False)] = True
            return flat.reshape(L, E)
        return self.dist.ideal_hot(self.n_hot)

    def hot_pairs(self) -> list[tuple[int, int]]:
        """The current hot set as (model layer, expert) pairs."""
        ls, es = np.nonzero(self.hot)
        return [(self.layout.moe_layers[l], int(e)) for l, e in zip(ls, es)]

    def expected_hit_rate(self) -> float:
        """The distribution's expected hit rate for the *current* hot set."""
        return self.dist.expected_hit_rate(self.hot)

    # -- steps -------------------------------------------------------------------------------------------------
    def decode_step(self, b: int, want_experts: bool = False, topics: list[int | None] | None = None) \
            -> StepResult:
        """One shared step of ``b`` tokens; ``topics`` (one per token) picks each token's routing
        distribution (default: topic 0 for all)."""
        L, k, eb = self.layout.n_moe, self.layout.k, self.layout.expert_bytes
        experts = self.dist.sample_mixed(list(topics)) if topics is not None else self.dist.sample(b)  # (B, L, k)
        layer_ix = np.broadcast_to(np.arange(L)[None, :, None], experts.shape)
        hit = self.hot[layer_ix, experts]                                        # (B, L, k)
        hits = hit.reshape(b, -1).sum(axis=1)
        keys = (layer_ix * self.layout.n_experts + experts).ravel()
        hot_keys = np.unique(keys[hit.ravel()])
        cold_keys = np.unique(keys[~hit.ravel()])
        misses = int(hit.size - hit.sum())
        np.add.at(self.counts.ravel(), keys, 1.0)
        self.steps += 1
        swaps, adapt_round = 0, None
        if self.adapt_every and self.steps % self.adapt_every == 0:
            self.rounds += 1
            adapt_round = self.rounds
            swaps = self._adapt()
        parts = self.cost.step_parts(b, hot_keys.size, cold_keys.size, misses, swaps, eb, self.cpu_factor)
        dur = sum(parts)
        self.lookups_total += hit.size
        self.hits_total += int(hit.sum())
        self.swaps_total += swaps
        self.swap_bytes_total += swaps * eb
        return StepResult(dur, hits, L * k, swaps, swaps * eb, adapt_round, experts if want_experts else None,
                          gpu_s=parts[0])

    def _adapt(self) -> int:
        n = 0
        if self.adapt_swaps and 0 < self.n_hot < self.hot.size:
            c = self.counts.ravel()
            hot = self.hot.ravel()
            cold_idx = np.flatnonzero(~hot)
            hot_idx = np.flatnonzero(hot)
            m = min(self.adapt_swaps, cold_idx.size, hot_idx.size)
            if m:
                best_cold = cold_idx[np.argpartition(-c[cold_idx], m - 1)[:m]]
                best_cold = best_cold[np.argsort(-c[best_cold], kind="stable")]
                worst_hot = hot_idx[np.argpartition(c[hot_idx], m - 1)[:m]]
                worst_hot = worst_hot[np.argsort(c[worst_hot], kind="stable")]
                gain = c[best_cold] - c[worst_hot]
                # hysteresis: the gain must beat both a floor and the counts' Poisson noise (z = 2)
                ok = gain >= np.maximum(self.min_gain, self.noise_z * np.sqrt(c[best_cold] + c[worst_hot]))
                n = m if ok.all() else int(np.argmin(ok))
                if n:
                    hot[best_cold[:n]] = True
                    hot[worst_hot[:n]] = False
        self.counts *= self.adapt_decay
        return n

    def prefill_s(self, n_tokens: int) -> float:
        """Modelled time to read a prompt of ``n_tokens`` (see the module docstring)."""
        if n_tokens <= 0:
            return 0.0
        c, eb = self.cost, self.layout.expert_bytes
        pi = self.dist.pi
        hot_pi, cold_pi = pi[self.hot], pi[~self.hot]
        batched = (c.t0_s + n_tokens * c.tp_s + expected_distinct(hot_pi, n_tokens) * eb / c.vram_Bps
                   + self.cpu_factor * (expected_distinct(cold_pi, n_tokens) * eb / c.cpu_Bps
                                        + n_tokens * float(cold_pi.sum()) * c.t_row_s))
        stream = cold_pi.size * eb / c.pcie_Bps
        return min(batched, max(stream, n_tokens * c.tp_s))

    def expected_step_s(self, b: int) -> float:
        """Expected duration of a decode step of ``b`` tokens for the current hot set (no swaps)."""
        pi = self.dist.pi
        hot_pi, cold_pi = pi[self.hot], pi[~self.hot]
        return self.cost.step_s(b, expected_distinct(hot_pi, b), expected_distinct(cold_pi, b),
                                b * float(cold_pi.sum()), 0, self.layout.expert_bytes, self.cpu_factor)


def modelled_throughput(users: Iterable[int] = (1, 4, 8), layout: Layout | None = None,
                        skew: str = "reference", **kw) -> dict[int, dict[str, float]]:
    """Expected total and per-user decode tok/s for each number of concurrent users, from the cost model with
    the ideal hot set (steady state, no swaps)."""
    model = OffloadModel(layout or Layout.reference(), skew=skew, initial_hot="ideal", **kw)
    out = {}
    for b in users:
        st = model.expected_step_s(b)
        out[b] = {"step_ms": st * 1000, "total_tok_s": b / st, "per_user_tok_s": 1 / st,
                  "hit_rate": model.expected_hit_rate()}
    return out


# The guides' measured figures, for comparison (docs/ENGINE_CONTRACT.md §1)
GUIDE_TABLE = {1: {"total_tok_s": 63.11, "slowest_tok_s": 63.11},
               4: {"total_tok_s": 127.58, "slowest_tok_s": 31.87},
               8: {"total_tok_s": 152.53, "slowest_tok_s": 19.0}}


def guide_step_s(users: int) -> float:
    return users / GUIDE_TABLE[users]["total_tok_s"]


__all__ = [
    "CostModel", "GUIDE_TABLE", "Layout", "OffloadModel", "RoutingDistribution", "SKEWS", "Skew", "StepResult",
    "expected_distinct", "expected_frequencies", "modelled_throughput", "parse_skew", "predicted_hit_rate",
    "read_strp", "trace_record", "REF_EXPERT_BYTES", "REF_HOT", "REF_MOE_LAYERS", "REF_N_EXPERTS",
    "REF_EXPERTS_USED", "N_TOPICS", "TOPIC_DRIFT",
]
