"""``SearchReport``: what the optimizer did for one compile — the e-graph it grew, the rules
that fired, the candidate programs it measured and verified, and the one it chose."""

from __future__ import annotations

import dataclasses
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate program: what differs from the default, its modelled cost, its median
    run time (None if it was not timed) and whether it matched the reference interpreter
    (None if it was not checked)."""

    description: str
    cost: float
    time_s: float | None
    verified: bool | None
    error: str | None


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """The optimizer's report. ``chosen`` indexes ``candidates``; it is None when no candidate
    was adopted and the program runs as translated (``note`` says why)."""

    egraph_nodes: int
    rules_fired: dict[str, int]
    fixed_point: bool
    iterations: int
    stop_reason: str
    candidates: list[Candidate]
    chosen: int | None
    cache_hit: bool
    note: str
    saturation_time_s: float
    time_s: float
    # Whether torch.export was skipped: the program came from the export cache.
    export_cache_hit: bool = False
    # What timed the candidates: "device" (the device's own clock, e.g. CUDA events, on the
    # launch path production runs take), "host" (the host clock), "" (nothing was timed).
    clock: str = ""

    @classmethod
    def from_core(cls, d: dict[str, Any], export_cache_hit: bool = False) -> SearchReport:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["export_cache_hit"] = export_cache_hit
        kw["candidates"] = [Candidate(**c) for c in d["candidates"]]
        kw["rules_fired"] = dict(d["rules_fired"])
        return cls(**kw)

    def __str__(self) -> str:
        lines = [
            f"e-graph: {self.egraph_nodes} e-nodes after {self.iterations} iterations "
            f"({self.stop_reason}; fixed point: {'yes' if self.fixed_point else 'no'}; "
            f"{self.saturation_time_s * 1e3:.0f} ms)",
            f"rules fired: {sum(self.rules_fired.values())} matches over "
            f"{len(self.rules_fired)} rules",
        ]
        if self.export_cache_hit:
            lines.append("program taken from the export cache (torch.export skipped)")
        if self.cache_hit:
            lines.append("choice taken from the compile cache")
        if self.note:
            lines.append(f"note: {self.note}")
        if self.clock:
            lines.append(f"timed by the {self.clock} clock")
        lines.append(f"{'':2}{'#':>3}  {'time':>10}  {'verified':>8}  candidate")
        for i, c in enumerate(self.candidates):
            mark = "->" if i == self.chosen else ""
            t = f"{c.time_s * 1e6:8.1f}us" if c.time_s is not None else f"{'-':>10}"
            v = {True: "yes", False: "NO", None: "-"}[c.verified]
            desc = c.description + (f"  [{c.error}]" if c.error else "")
            lines.append(f"{mark:2}{i:>3}  {t}  {v:>8}  {desc}")
        lines.append(f"search took {self.time_s:.2f} s")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Saves a bar chart of the candidates' run times as a PNG (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("SearchReport.plot needs matplotlib (pip install matplotlib)") from e
        timed = [(i, c) for i, c in enumerate(self.candidates) if c.time_s is not None]
        fig, ax = plt.subplots(figsize=(8, 0.4 * len(timed) + 1.5))
        labels = [f"{i}: {c.description[:60]}" for i, c in timed]
        colors = ["tab:green" if i == self.chosen else "tab:blue" for i, _ in timed]
        ax.barh(labels, [c.time_s * 1e6 for _, c in timed], color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("median time per call (us)")
        ax.set_title("Ember candidates (green: chosen)")
        fig.tight_layout()
        fig.savefig(os.fspath(path), format="png")
        plt.close(fig)


_last: SearchReport | None = None


def record(report: SearchReport) -> None:
    global _last
    _last = report


def last_report() -> SearchReport | None:
    """The report of the most recent compile in this process (torch.compile users reach
    their reports here)."""
    return _last
