"""`echo`: the prompt sent back as the start of a completion, with its logprobs when asked for."""

from __future__ import annotations

from edgeinfer.api.jobs import Job
from edgeinfer.node.backends.base import ChoiceDelta
from edgeinfer.node.backends.local.choice import Choice
from edgeinfer.node.backends.local.logprobs import Pieces
from edgeinfer.types import RequestOutput


def echo_ready(job: Job, out: RequestOutput) -> bool:
    # Prompt logprobs arrive with the first output that carries a token; the echo waits for them.
    return job.logprobs is None or out.prompt_logprobs is not None or bool(out.new_token_ids) or out.finished


def echo_delta(job: Job, index: int, choice: Choice, out: RequestOutput, pieces: Pieces) -> ChoiceDelta:
    if job.logprobs is None:
        return ChoiceDelta(index, choice.prompt_text)
    entries = pieces.prompt_entries(choice.request.prompt_token_ids, out.prompt_logprobs or [])
    return ChoiceDelta(index, choice.prompt_text, entries)
