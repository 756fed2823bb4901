"""What a GPU check run is made of: the sizes per mode, a stage, one run of it, the context the
stages share, and the summary table's rows (bench/gpu_check.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
STAGE_MISSING = 3  # a stage's exit code when what it runs is not there (yet)
# ... and when this device cannot run it (one GPU for the two-GPU stage): reported as skipped,
# which, unlike a stage left unstarted, does not fail the run
STAGE_SKIPPED = 4

# Sizes per mode. gpu: a ~0.9B Llama (head_dim 128, bf16) at batch 64; cpu twin: toys.
SIZES = {
    "gpu": dict(
        device="cuda", budget_s=480.0,
        model=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                   max_position_embeddings=4096),
        tokenizer_vocab=8000, num_prompts=64, prompt_len=512, output_len=256,
        max_num_batched_tokens=8192, kv_cache_gib=8.0,
        # expected on an H200: env 10, kernels 80, model 30, engines 40 each, hf 25,
        # transfers 30 each, tests 150 (Triton builds for ~60 kernel variants; 10 engine
        # models, 6 of them under CUDA graphs): ~440 of the 480; tensor_parallel, last, skips
        # in seconds on one GPU and takes ~100 on two with its t=2 graphs run (there:
        # --budget-s 570)
        stage_s=dict(env=30, kernels=170, model=75, engine_graphs=80, hf=60, engine_eager=70,
                     transfer=50, transfer_ucx=90, tests=200, tensor_parallel=120),
        kernels_args=[], transfer_args=[],
        # t=1 against t=2: greedy tokens of `num_prompts`, decode steps at `batches` (prompts of
        # `context` tokens), the bare all-reduce at `allreduce_batches`, a KV transfer
        tensor_parallel=dict(num_prompts=16, prompt_len=256, output_len=64, batches=[1, 16, 64],
                             context=256, steps=16, allreduce_batches=[1, 16, 64],
                             allreduce_calls=100, transfer_args=["--tokens", "2048", "8192",
                                                                 "--iters", "5"],
                             transfer_deadline_s=20)),
    "cpu": dict(
        device="cpu", budget_s=270.0,
        model=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                   max_position_embeddings=512),
        tokenizer_vocab=512, num_prompts=4, prompt_len=24, output_len=6,
        max_num_batched_tokens=256, kv_cache_gib=0.0625,
        stage_s=dict(env=30, kernels=90, model=40, engine_graphs=60, hf=60, engine_eager=60,
                     transfer=60, transfer_ucx=60, tests=90, tensor_parallel=90),
        kernels_args=["--batches", "2", "--contexts", "40", "--prompts", "24", "--chunk", "8:24",
                      "--check-lens", "1,40", "--check-segments", "20:0,9:24",
                      "--long-context", "40", "--long-batch", "1"],
        transfer_args=["--tokens", "64", "--iters", "3"],
        tensor_parallel=dict(num_prompts=4, prompt_len=24, output_len=6, batches=[1, 4],
                             context=24, steps=6, allreduce_batches=[1, 4], allreduce_calls=10,
                             transfer_args=["--tokens", "64", "--iters", "3"],
                             transfer_deadline_s=15)),
}
MIN_STAGE_S = 5.0  # less than this left of the global budget: the stage is not started


# ---------------------------------------------------------------------------------- report
@dataclass
class Row:
    """One line of the summary table. result: pass | FAIL | info (no target) | missing (a
    dependency not there) | error | timeout | skipped (not started, or STAGE_SKIPPED: the
    device cannot run it)."""

    stage: str
    figure: str
    target: str
    result: str

    def as_dict(self) -> dict:
        return {"stage": self.stage, "figure": self.figure, "target": self.target,
                "result": self.result}


@dataclass
class StageRun:
    name: str
    status: str                 # ok | failed | missing | timeout | error | skipped
    seconds: float = 0.0
    returncode: Optional[int] = None
    data: Optional[dict] = None  # the stage's last JSON line
    output: str = ""
    note: str = ""


@dataclass
class Stage:
    name: str
    command: Callable[["Context"], list[str] | str]  # argv, or why it cannot run (missing)
    rows: Callable[["Context", StageRun], list[Row]]
    needs: tuple[str, ...] = ()


@dataclass
class Context:
    mode: str                      # gpu | cpu
    sizes: dict
    model_dir: str
    runs: dict[str, StageRun] = field(default_factory=dict)

    @property
    def twin(self) -> bool:
        return self.mode == "cpu"

    def verdict(self, ok: bool) -> str:
        """Performance targets apply on the GPU only: the twin's figures are plumbing."""
        return "info" if self.twin else ("pass" if ok else "FAIL")


def _failed_rows(name: str, run: StageRun) -> list[Row]:
    reason = run.note or f"exit {run.returncode}"
    return [Row(name, reason[:90], "runs", run.status if run.status != "failed" else "error")]


def run_passed(rows: list[Row], runs: dict[str, StageRun]) -> bool:
    """Every row passes or informs, bar those of a stage that ran and skipped itself
    (STAGE_SKIPPED: one GPU for the two-GPU stage); a stage left unstarted (the budget spent,
    a stage it needs failed) fails the run."""
    skipped_itself = {name for name, run in runs.items()
                      if run.status == "skipped" and run.returncode is not None}
    return all(r.result in ("pass", "info") or (r.result == "skipped" and r.stage in skipped_itself)
               for r in rows)


def format_table(rows: list[Row]) -> str:
    widths = [max(len(getattr(r, f)) for r in rows + [Row("stage", "figure", "target", "result")])
              for f in ("stage", "figure", "target", "result")]
    widths = [min(w, cap) for w, cap in zip(widths, (44, 96, 40, 8))]
    lines = []
    for r in [Row("stage", "figure", "target", "result")] + rows:
        lines.append("  ".join(getattr(r, f)[:w].ljust(w) for f, w in
                               zip(("stage", "figure", "target", "result"), widths)).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)

