"""The chaos table: one row per phase (fault, requests, each class, recovery time, p99 TTFT
during the fault and overall, blocks back), as markdown, plus the per-request problem listing.
"""

from __future__ import annotations

from typing import Optional

from tests.chaos_support.runner import PhaseResult

HEADER = ("| phase | fault | requests | correct | failed | wrong | hung | unclear | cancelled | "
          "recovery s | p99 TTFT during fault s | p99 TTFT s | blocks back |")


def _s(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def row(p: PhaseResult) -> str:
    c = p.counts
    during = p.ttft_p99(during_fault=True) if p.fault_at is not None else None
    return (f"| {p.plan.name} | {p.plan.fault.describe()} | {len(p.results)} | {c['correct']} | "
            f"{c['failed']} | {c['wrong']} | {c['hung']} | {c['unclear']} | {c['cancelled']} | "
            f"{_s(p.recovery_s)} | {_s(during)} | {_s(p.ttft_p99())} | "
            f"{'yes' if p.quiescent else 'NO'} |")


def table(phases: list[PhaseResult]) -> str:
    sep = "|" + "---|" * (HEADER.count("|") - 1)
    return "\n".join([HEADER, sep] + [row(p) for p in phases])


def details(phases: list[PhaseResult]) -> str:
    lines = []
    for p in phases:
        problems = p.listing()
        extra = p.notes + ([f"not quiescent: {p.quiesce_detail}"] if not p.quiescent else [])
        if problems or extra:
            lines.append(f"## {p.plan.name}")
            lines.extend(f"  note: {n}" for n in extra)
            lines.extend(f"  {line}" for line in problems)
    return "\n".join(lines)
