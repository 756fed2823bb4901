"""HTTP front door: OpenAI API, colocated/disaggregated routing policy, admission, metrics."""
