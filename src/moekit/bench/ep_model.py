"""A cost model of expert parallelism: the all-to-alls of :class:`moekit.distributed.ExpertParallelMoE`
against its expert GEMMs, per MoE layer and rank. A model, not a measurement.

Assumptions (per rank, T tokens, K experts per token, R = T*K routed rows, W ranks, El = E/W):

- balanced, uniform routing: each rank computes R expert rows, and a token goes to another given rank
  (once, whatever the number of its experts there) with probability p = 1 - C(E - El, K) / C(E, K), so
  T*(W-1)*p token rows leave a rank;
- a token row is D bf16 values, with its K choices beside it on the way out (2K fp32: 8K bytes);
- "host" splits send exactly those rows; "device" splits send a fixed slot of T rows to each of the
  W-1 other ranks;
- one all-to-all costs ``latency + bytes sent / bandwidth`` (bandwidth per direction per GPU: every
  rank sends and receives at once over a non-blocking switch);
- four row all-to-alls per layer and step: dispatch and combine forward, their reverses backward (the
  layer also exchanges its counts and, twice, the choice tables: small, their latency not counted);
- expert FLOPs 6*R*D*F forward and 12*R*D*F backward, at a sustained rate (TF/s);
- overlap with C chunks: each chunk moves 1/C of the bytes and pays the full latency; the first
  chunk's dispatch and the last chunk's combine cannot overlap the GEMMs, so a layer's forward takes
  ``max(c + 2*a_C, 2*C*a_C + c/C)`` for c ms of GEMMs and a_C ms per chunk all-to-all (the backward
  alike), and the exposed communication is that minus c.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import BLOCK_SHAPES, MoEShape

LINKS = {  # name: (GB/s per direction, latency in us)
    "nvlink4": (450.0, 5.0),
    "ib-400g": (50.0, 10.0),
}
EP_SIZES = (2, 4, 8)
CHUNKS = (1, 2, 4, 8)


@dataclass(frozen=True)
class LayerCost:
    """One layer on one rank, forward plus backward, in ms (``exposed``: {chunks: ms})."""

    host_mb: float
    a2a_host: float
    a2a_device: float
    compute: float
    exposed: dict


def _a2a_ms(rows: float, row_bytes: float, gbs: float, latency_us: float, chunks: int = 1) -> float:
    """One chunk's all-to-all: latency + its share of ``rows`` rows of ``row_bytes`` over the link."""
    return latency_us * 1e-3 + rows * row_bytes / chunks / (gbs * 1e9) * 1e3


def off_rank_share(shape: MoEShape, world: int) -> float:
    """The probability that a token goes to a given other rank: one of its K (distinct, uniformly
    chosen) experts is among that rank's El."""
    return 1.0 - math.comb(shape.e - shape.e // world, shape.top_k) / math.comb(shape.e, shape.top_k)


def layer_cost(shape: MoEShape, world: int, gbs: float, latency_us: float, tflops: float) -> LayerCost:
    """The model for one shape (``shape.tokens`` tokens per rank) at EP size ``world``."""
    r = shape.tokens * shape.top_k
    off_rank = shape.tokens * (world - 1) * off_rank_share(shape, world)
    slots = shape.tokens * (world - 1)
    out_bytes, back_bytes = shape.d * 2 + 8 * shape.top_k, shape.d * 2  # (a token's choices go with it)

    def a2a(rows, chunks=1):  # one dispatch and one combine
        return _a2a_ms(rows, out_bytes, gbs, latency_us, chunks) + _a2a_ms(rows, back_bytes, gbs, latency_us, chunks)

    fwd = 6 * r * shape.d * shape.f / (tflops * 1e12) * 1e3
    exposed = {}
    for c in CHUNKS:
        a = a2a(off_rank, c) / 2  # a chunk's all-to-all, on average
        exposed[c] = sum(max(g + 2 * a, 2 * c * a + g / c) - g for g in (fwd, 2 * fwd))
    return LayerCost(
        host_mb=off_rank * out_bytes / 1e6,
        a2a_host=2 * a2a(off_rank),
        a2a_device=2 * a2a(slots),
        compute=3 * fwd,
        exposed=exposed,
    )


def _verdict(cost: LayerCost) -> tuple[int, str]:
    best = min(CHUNKS, key=lambda c: (round(cost.exposed[c], 3), c))
    share = cost.exposed[best] / cost.compute
    if share <= 0.05:
        return best, "yes"
    return best, "partly" if cost.exposed[best] <= 0.5 * cost.exposed[1] else "no"


def table(shapes, links: dict, tflops: float, ep_sizes=EP_SIZES) -> str:
    """The markdown tables, one per link."""
    lines = [
        "Expert-parallel cost model: a model, not a measurement. Per MoE layer and rank, forward + backward,",
        f"balanced routing, bf16 rows, expert GEMMs at {tflops:g} TF/s sustained (moekit.bench.ep_model states",
        "the assumptions). a2a: the four all-to-alls (dispatch, combine and their reverses), each token sent",
        "once per rank that holds one of its experts, with host splits (exact sizes) or device splits (a",
        "T-row slot per peer). exposed: the all-to-all time that chunked overlap leaves on the critical path",
        "(host splits).",
    ]
    for name, (gbs, latency_us) in links.items():
        lines += ["", f"### {name}: {gbs:g} GB/s per direction, {latency_us:g} us per all-to-all", "",
                  "| shape | T/rank | EP | MB sent/a2a | a2a ms host | a2a ms device | expert ms | a2a/expert "
                  "| exposed, chunks=1 | best chunks: exposed | hidden? |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for shape in shapes:
            for world in ep_sizes:
                if shape.e % world:
                    continue
                cost = layer_cost(shape, world, gbs, latency_us, tflops)
                best, verdict = _verdict(cost)
                lines.append(
                    f"| {shape.name} | {shape.tokens} | {world} | {cost.host_mb:.0f} | {cost.a2a_host:.2f} | "
                    f"{cost.a2a_device:.2f} | {cost.compute:.2f} | {cost.a2a_host / cost.compute:.2f} | "
                    f"{cost.exposed[1]:.2f} | {best}: {cost.exposed[best]:.2f} | {verdict} |"
                )
    lines += ["", "hidden?: yes = exposed at the best chunk count within 5% of the expert time; partly = "
              "overlap removes at least half of the all-to-all time; no = the link is the bottleneck."]
    return "\n".join(lines)


def main(*, tokens: int | None = None, link: list[str] | None = None, link_gbs: float | None = None,
         link_us: float = 5.0, tflops: float = 600.0, shapes=None) -> str:
    """The text that ``python -m moekit bench --ep-model`` prints."""
    import dataclasses

    shapes = list(shapes or BLOCK_SHAPES.values())
    if tokens:
        shapes = [dataclasses.replace(s, tokens=tokens) for s in shapes]
    links = {n: LINKS[n] for n in link} if link else ({} if link_gbs else dict(LINKS))
    if link_gbs:
        links["custom"] = (link_gbs, link_us)
    return table(shapes, links, tflops)
