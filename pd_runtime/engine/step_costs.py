"""What an engine step costs, learned from the steps it runs: the live cost model routing uses.

A step's seconds are fitted, by recursive least squares with exponential forgetting, to what it
computed:

    seconds = step + prefill_token * P + prefill_attention * P*ctx + decode_seq * D
              + decode_context * sum(ctx of the decoded sequences)

where P is the prompt tokens computed in the step, ctx the context each of them attends to, and
D the sequences that decoded one token. The forgetting (half-life ~`half_life_steps`) follows a
machine whose speed changes (a neighbour's load, thermal limits); the prior keeps coefficients
sane until a kind of step has been seen. Predictions never use a negative coefficient.

Also kept: step-time, batch-size and tokens-per-step averages, and a histogram of step times,
for /metrics; and the decode part of the step time lately (`decode_s_ewma`: each step's seconds
shared between its prompt tokens and its decodes as the fit predicts them), which the router
reads as the step a new stream will see once the prompts queued ahead of it are computed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

FEATURES = ("step_s", "prefill_token_s", "prefill_attention_s", "decode_seq_s",
            "decode_context_s")
# Units the features are counted in, so the fit is well conditioned (coefficients per unit).
_UNITS = np.array([1.0, 1e3, 1e6, 10.0, 1e4])
STEP_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class StepWork:
    prefill_tokens: int = 0
    prefill_attention: int = 0   # sum over prefill tokens of the context each attends to
    decode_seqs: int = 0
    decode_context: int = 0      # sum of the decoded sequences' context lengths

    def vector(self) -> np.ndarray:
        raw = np.array([1.0, self.prefill_tokens, self.prefill_attention, self.decode_seqs,
                        self.decode_context])
        return raw / _UNITS


# A cautious prior (a small model on two CPU cores): 5 ms a step, 5k prompt tokens/s, 1 ms per
# decoded sequence. Weak: a few dozen steps of each kind outweigh it.
_PRIOR = np.array([5e-3, 0.2, 0.0, 1e-2, 0.0])


class StepCostModel:
    def __init__(self, half_life_steps: float = 500.0, prior_weight: float = 1e-2):
        self.forget = 0.5 ** (1.0 / half_life_steps)
        self.theta = _PRIOR.copy()  # seconds per feature unit
        self._prior_P = np.eye(len(FEATURES)) / prior_weight  # inverse information: large = unsure
        self.P = self._prior_P.copy()
        self._max_trace = float(np.trace(self.P))
        self._error_scale = 0.01  # seconds: typical |error| of a prediction lately
        self.steps = 0
        self.seconds = 0.0
        self.tokens = 0
        self.batch = 0
        self.prefill_tokens = 0  # prompt tokens computed, since start
        self.decode_tokens = 0   # tokens decoded (one per decoded sequence per step)
        self.step_counts = [0] * (len(STEP_BUCKETS_S) + 1)
        self._ewma_step_s = None
        self._ewma_batch = None
        self._ewma_tokens = None
        self._ewma_decode_s = None

    def observe(self, work: StepWork, seconds: float) -> None:
        x = work.vector()
        Px = self.P @ x
        gain = Px / (self.forget + x @ Px)
        # A lone outlier (a page fault storm, a neighbour's burst) moves the fit by a bounded
        # step; a lasting change raises the scale and gets through within a few dozen steps.
        predicted = x @ self.theta
        error = seconds - predicted
        bound = max(4.0 * self._error_scale, 0.5 * abs(predicted)) if self.steps >= 32 \
            else float("inf")  # the first steps learn freely from the prior
        self._error_scale = 0.9 * self._error_scale + 0.1 * min(abs(error), 10 * bound)
        self.theta = self.theta + gain * max(-bound, min(bound, error))
        self.P = self.P - np.outer(gain, Px)
        self.P = 0.5 * (self.P + self.P.T)  # rounding would slowly make it asymmetric
        if np.trace(self.P) < self._max_trace:  # forget only while it cannot wind up: a
            self.P /= self.forget                # feature never seen would grow without end
        if not np.all(np.isfinite(self.theta)):  # numerically lost: start over from the prior
            self.theta, self.P = _PRIOR.copy(), self._prior_P.copy()
        batch = work.decode_seqs + (1 if work.prefill_tokens else 0)
        tokens = work.prefill_tokens + work.decode_seqs
        self.steps += 1
        self.seconds += seconds
        self.tokens += tokens
        self.batch += batch
        self.prefill_tokens += work.prefill_tokens
        self.decode_tokens += work.decode_seqs
        self.step_counts[bisect.bisect_left(STEP_BUCKETS_S, seconds)] += 1
        if not work.decode_seqs:
            # A step of prompts only (the first request on an idle worker) is waited through
            # by no running stream: not part of the step time streams see.
            return
        a = 0.05
        self._ewma_step_s = seconds if self._ewma_step_s is None else \
            (1 - a) * self._ewma_step_s + a * seconds
        self._ewma_batch = batch if self._ewma_batch is None else \
            (1 - a) * self._ewma_batch + a * batch
        self._ewma_tokens = tokens if self._ewma_tokens is None else \
            (1 - a) * self._ewma_tokens + a * tokens
        # The step's decode share, by the fit (the step's fixed cost counted as decode): the
        # measured seconds, slowed or sped up by whatever they were, split in that proportion.
        t = np.maximum(self.theta, 0.0) * x
        prefill = t[1] + t[2]
        decode_s = seconds * (1.0 - prefill / max(float(t.sum()), 1e-12))
        self._ewma_decode_s = decode_s if self._ewma_decode_s is None else \
            (1 - a) * self._ewma_decode_s + a * decode_s

    def forget_recent(self) -> None:
        """Keep what the fit learned; forget the counts and the recent averages. For the
        warm-up's steps: they seed the fit, but ran alone and cold, and a step-time average
        started from a lone 1024-token prefill read ~0.2 s for dozens of steps after (the
        router took that for its running requests' step time and refused requests at once
        on an idle worker)."""
        self.steps = self.tokens = self.batch = 0
        self.seconds = 0.0
        self.prefill_tokens = self.decode_tokens = 0
        self.step_counts = [0] * (len(STEP_BUCKETS_S) + 1)
        self._ewma_step_s = self._ewma_batch = self._ewma_tokens = None
        self._ewma_decode_s = None

    def coefficients(self) -> dict:
        """Seconds per unit of each feature (per step, per prompt token, per prompt token x
        context token, per decoded sequence, per context token of a decoded sequence)."""
        return {name: max(0.0, float(c / u)) for name, c, u in zip(FEATURES, self.theta, _UNITS)}

    def predict(self, work: StepWork) -> float:
        return float(np.maximum(self.theta, 0.0) @ work.vector())

    def report(self) -> dict:
        """Plain numbers for the load report (the router's cost model reads these)."""
        return {"coefficients": self.coefficients(), "steps": self.steps,
                "busy_s": self.seconds, "tokens": self.tokens, "batch_sum": self.batch,
                "step_s_ewma": self._ewma_step_s or 0.0,
                "decode_s_ewma": self._ewma_decode_s or 0.0, "batch_ewma": self._ewma_batch or 0.0,
                "tokens_per_step_ewma": self._ewma_tokens or 0.0,
                "step_buckets_s": list(STEP_BUCKETS_S), "step_counts": list(self.step_counts),
                "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens}
