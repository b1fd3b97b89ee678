"""What the compiler decided, per GEMM site and per graph: ``backend.report``."""

from __future__ import annotations

import dataclasses
from typing import Optional

from fp4compile.recipe import HIGH, Recipe
from fp4compile.sites import ROLES, CompileContext, GemmSite, StageGraph


@dataclasses.dataclass
class SiteView:
    """A GEMM site as the report shows it (one row of the precision table)."""

    name: str
    block: Optional[int]
    kind: str
    precision: str
    reason: str
    shapes: dict  # role -> (M, N, K)
    roles: dict  # role -> RoleInfo
    graph_id: int

    @property
    def kernel(self) -> Optional[str]:
        kernels = sorted({r.kernel for r in self.roles.values() if r.kernel})
        return ", ".join(kernels) if kernels else None

    @property
    def kernel_reason(self) -> str:
        reasons = sorted({r.kernel_reason for r in self.roles.values() if r.kernel_reason})
        return "; ".join(reasons)


def _view(site: GemmSite) -> SiteView:
    return SiteView(
        site.name, site.block, site.kind, site.precision, site.reason,
        {role: info.shape for role, info in site.roles.items()}, dict(site.roles), site.graph_id,
    )


class Report:
    """Sites, precisions, kernels and per-pass graphs of a backend's compilations."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.contexts: list[CompileContext] = []

    def add_context(self, ctx: CompileContext) -> None:
        self.contexts.append(ctx)

    @property
    def latest(self) -> list[CompileContext]:
        """The latest compilation of each graph (recompiles replace earlier ones)."""
        by_graph = {}
        for ctx in self.contexts:
            by_graph[ctx.graph_id] = ctx
        return [by_graph[k] for k in sorted(by_graph)]

    @property
    def sites(self) -> list[SiteView]:
        return [_view(s) for ctx in self.latest for s in ctx.sites]

    @property
    def graphs(self) -> list[StageGraph]:
        return [g for ctx in self.latest for g in ctx.graphs]

    @property
    def fallbacks(self) -> list[str]:
        return [f for ctx in self.latest for f in ctx.fallbacks]

    @property
    def n_blocks(self) -> int:
        return max((ctx.n_blocks for ctx in self.latest), default=0)

    def counts(self) -> dict:
        """Number of GEMMs (site x role that ran) per precision."""
        out: dict = {}
        for site in self.sites:
            for info in site.roles.values():
                out[info.precision] = out.get(info.precision, 0) + 1
        return out

    def flop_shares(self) -> dict:
        """Share of GEMM FLOPs per precision over every role-tagged GEMM with a known shape."""
        totals: dict = {}
        for site in self.sites:
            for info in site.roles.values():
                if isinstance(info.flops, int):
                    totals[info.precision] = totals.get(info.precision, 0) + info.flops
        total = sum(totals.values()) or 1
        return {k: v / total for k, v in totals.items()}

    def precision_table(self) -> str:
        rows = [("site", "block", "M x N x K (fprop)", "fprop", "dgrad", "wgrad", "reason")]
        for s in self.sites:
            shape = s.shapes.get("fprop")
            shape_text = " x ".join(str(d) for d in shape) if shape else "-"
            cells = []
            for role in ROLES:
                info = s.roles.get(role)
                if info is None:
                    cells.append("-")
                else:
                    tag = info.precision if info.precision != HIGH else "high"
                    cells.append(tag + ("+rht" if info.rht else "") + ("+sr" if "sr" in info.rounding else ""))
            block = "-" if s.block is None else str(s.block)
            rows.append((s.name, block, shape_text, *cells, s.reason))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        shares = self.flop_shares()
        counts = self.counts()
        summary = ", ".join(f"{k}: {counts[k]} GEMMs, {100 * shares.get(k, 0):.1f}% of FLOPs" for k in sorted(counts))
        lines.append(f"{len(self.sites)} GEMM sites in {self.n_blocks} blocks; {summary or 'no GEMM has run yet'}")
        for f in self.fallbacks:
            lines.append(f"fallback: {f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.precision_table()
