"""bench/tensor_parallel.py's output: the table it prints and the figure it draws (decode step
time by batch at t=1 and t=2; what each rank holds)."""

from __future__ import annotations


def report(result: dict) -> None:
    mib = 2 ** 20
    print(f"\n{'batch':>5} {'t=1 ms/step':>12} {'t=2 ms/step':>12} {'t=2/t=1':>8} "
          f"{'t=1 CPU ms':>11} {'t=2 CPU ms':>11} "
          f"{'t=2 all-reduce ms':>18} {'bare all-reduce ms':>19} {'calls':>6}")
    for row in result["decode"]:
        print(f"{row['batch']:>5} {row['t1_step_ms']:>12.2f} {row['t2_step_ms']:>12.2f} "
              f"{row['t2_step_ms'] / row['t1_step_ms']:>8.2f} {row['t1_cpu_ms']:>11.2f} "
              f"{row['t2_cpu_ms']:>11.2f} {row['t2_allreduce_ms']:>18.2f} "
              f"{row['bare_allreduce_ms']:>19.2f} {row['allreduces_per_step']:>6.0f}")
    print(f"\n{'t':>2} {'rank':>4} {'weights MiB':>12} {'packed MiB':>11} {'tables MiB':>11} "
          f"{'KV cache MiB':>13} {'KV B/token':>11} {'decode buf MiB':>15} {'RSS MiB':>8}")
    for r in result["memory"]:
        print(f"{r['tp']:>2} {r['rank']:>4} {r['weights'] / mib:>12.1f} {r['packed'] / mib:>11.1f} "
              f"{r['tables'] / mib:>11.1f} {r['kv_cache_bytes'] / mib:>13.1f} "
              f"{r['kv_bytes_per_token']:>11} {r['decode_buffer_bytes'] / mib:>15.1f} "
              f"{r['rss_bytes'] / mib:>8.1f}")
    print(f"(RSS of a process with torch and pd_runtime imported, before the engine: "
          f"{result['memory'][0]['base_rss_bytes'] / mib:.0f} MiB)")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2 ** 20
    rows, cfg = result["decode"], result["config"]
    batches = [r["batch"] for r in rows]
    fig, (steps, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps.plot(batches, [r["t1_step_ms"] for r in rows], marker="o",
               label=f"t=1 ({cfg['cores']} threads)")
    per_rank = max(1, cfg["cores"] // 2)
    steps.plot(batches, [r["t2_step_ms"] for r in rows], marker="o",
               label=f"t=2 ({per_rank} thread{'s' if per_rank > 1 else ''} a rank)")
    steps.plot(batches, [r["t2_allreduce_ms"] for r in rows], "--", marker=".",
               label="t=2: driver's all-reduces in the step")
    steps.plot(batches, [r["bare_allreduce_ms"] for r in rows], ":", marker=".",
               label="t=2: bare gloo all-reduces (same calls)")
    steps.set(xscale="log", xticks=batches, xticklabels=[str(b) for b in batches],
              xlabel="decode batch", ylabel="ms per decode step",
              title=f"decode step, context {cfg['context']}, {cfg['dtype_run']}")
    steps.minorticks_off()
    steps.set_ylim(bottom=0)
    labels = [f"t={r['tp']} rank {r['rank']}" for r in result["memory"]]
    parts = [("weights", "weights"), ("packed", "packed copies"),
             ("kv_cache_bytes", "KV cache"), ("decode_buffer_bytes", "decode buffer")]
    bottom = [0.0] * len(labels)
    for key, name in parts:
        values = [r[key] / mib for r in result["memory"]]
        memory.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    memory.scatter(labels, [r["rss_bytes"] / mib for r in result["memory"]], color="black",
                   marker="_", s=900, label="process RSS", zorder=3)
    memory.axhline(result["memory"][0]["base_rss_bytes"] / mib, linestyle=":", color="gray",
                   label="RSS with torch imported, no engine")
    top = max(r["rss_bytes"] for r in result["memory"]) / mib
    memory.set(ylabel="MiB", title="memory per rank", ylim=(0, 1.5 * top))  # room for the legend
    for ax in (steps, memory):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Tensor parallel on {cfg['cores']} CPU cores: two cores are not a "
                 "tensor-parallel target (same cores at t=1 and t=2)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
