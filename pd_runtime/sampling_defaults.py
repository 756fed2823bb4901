"""A model's own sampling defaults: the fields of its generation_config.json that a request
which leaves them out gets, as vLLM applies them (torch-free; the router reads them off the
workers' model card).

Read: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens (as max_tokens:
a bound on the default length of a request that names none, never on one it names). `do_sample`
is not read, as vLLM does not: a checkpoint that ships a temperature is sampled with it. A value
this engine would refuse, or a file that is not JSON, is left out with a warning naming it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Union

from pd_runtime.api import InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_sampling_defaults(model_dir: Union[str, Path]) -> dict:
    """{SamplingParams field: value} from the directory's generation_config.json ({} without)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        log.warning("%s: not valid JSON (%s); no sampling defaults from it", path, exc)
        return {}
    defaults = {}
    for key, name in _FIELDS.items():
        value = raw.get(key) if isinstance(raw, dict) else None
        if value is None:
            continue
        if name in ("top_k", "max_tokens") and isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            SamplingParams(**{name: value})
        except (InvalidRequestError, TypeError) as exc:
            log.warning("%s: %s=%r left out of the sampling defaults: %s", path, key, value, exc)
            continue
        defaults[name] = value
    return defaults
