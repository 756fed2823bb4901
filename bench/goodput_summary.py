"""bench/goodput.py's arithmetic on finished requests: percentiles, the SLO test, a point's
summary (throughput, goodput, attainment overall and per prompt class, latency percentiles,
client lag, refusal time) and its table row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from bench.goodput_client import RequestRecord
    from bench.goodput_load import PointPlan

from pd_runtime.planner.stats import percentile  # noqa: E402  (the simulator's definition too)


def stats(values: list[float], qs=(50, 90, 99)) -> dict:
    return {f"p{q:g}": percentile(values, q) for q in qs}


def is_good(rec: RequestRecord, slo_ttft: float, slo_tpot: float) -> bool:
    """Completed within both SLOs (a one-token request has no TPOT and passes that one)."""
    return (rec.outcome == "completed" and rec.ttft_s <= slo_ttft
            and (rec.tpot_s is None or rec.tpot_s <= slo_tpot))


def latency_stats(records: list[RequestRecord], slo_ttft: float, slo_tpot: float) -> dict:
    done = [r for r in records if r.outcome == "completed"]
    return {"completed": len(done),
            "good": sum(is_good(r, slo_ttft, slo_tpot) for r in records),
            "ttft_s": stats([r.ttft_s for r in done]),
            "tpot_s": stats([r.tpot_s for r in done if r.tpot_s is not None]),
            "itl_s": stats([x for r in done for x in r.itl_s]),
            "e2e_s": stats([r.e2e_s for r in done])}


def summarize(plan: PointPlan, records: list[RequestRecord], slo_ttft: float,
              slo_tpot: float) -> dict:
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = max(ends) - min(r.scheduled_s for r in records) if ends else 0.0
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    done = [r for r in records if r.outcome == "completed"]
    refused = [r for r in records if r.outcome == "refused"]
    lags = [r.lag_s for r in records if r.sent_s is not None]
    out = {"name": plan.name, "offered_rate": plan.offered_rate,
           "concurrency": plan.concurrency, "sent": len(records),
           "refused": len(refused), "failed": len(records) - len(done) - len(refused),
           "duration_s": duration, "throughput_rps": per_s(len(done)),
           "output_tok_s": per_s(sum(r.output_tokens for r in done)),
           **latency_stats(records, slo_ttft, slo_tpot),
           "lag_s": {**stats(lags, (50, 99)), "max": max(lags, default=None)},
           "refusal_s": {**stats([r.e2e_s for r in refused], (50,)),
                         "max": max((r.e2e_s for r in refused), default=None)}}
    out["goodput_rps"] = per_s(out["good"])
    out["attainment"] = out["good"] / len(records) if records else 0.0
    kinds = sorted({r.kind for r in records})
    if len(kinds) > 1:
        out["by_kind"] = {}
        for k in kinds:
            mine = [r for r in records if r.kind == k]
            stats_k = latency_stats(mine, slo_ttft, slo_tpot)
            out["by_kind"][k] = {**stats_k, "sent": len(mine),
                                 "refused": sum(r.outcome == "refused" for r in mine),
                                 "attainment": stats_k["good"] / len(mine)}
    errors = [r.error for r in records if r.outcome == "failed"]
    out["first_error"] = errors[0] if errors else None
    return out


TABLE_HEADER = (f"{'point':>10} {'sent':>5} {'done':>5} {'refus':>5} {'fail':>4} {'dur_s':>6} "
                f"{'req/s':>6} {'tok/s':>7} {'good/s':>6} {'attain':>6}  {'TTFT p50/p99 s':>13}  "
                f"{'TPOT p50/p99 ms':>15} {'ITL p99':>7} {'e2e p99':>7} {'lag p99':>7}")


def table_row(s: dict) -> str:
    def f(x, scale=1.0, digits=2):
        return "-" if x is None else f"{x * scale:.{digits}f}"

    return (f"{s['name']:>10} {s['sent']:>5} {s['completed']:>5} {s['refused']:>5} "
            f"{s['failed']:>4} {s['duration_s']:>6.1f} {s['throughput_rps']:>6.2f} "
            f"{s['output_tok_s']:>7.1f} {s['goodput_rps']:>6.2f} {s['attainment']:>6.0%}  "
            f"{f(s['ttft_s']['p50']):>6}/{f(s['ttft_s']['p99']):<6}  "
            f"{f(s['tpot_s']['p50'], 1e3, 1):>7}/{f(s['tpot_s']['p99'], 1e3, 1):<7} "
            f"{f(s['itl_s']['p99'], 1e3, 1):>7} {f(s['e2e_s']['p99']):>7} "
            f"{f(s['lag_s']['p99'], 1e3, 1):>7}")
