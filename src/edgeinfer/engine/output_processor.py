"""Per-request output state: incremental text, stop strings, logprobs, timeline → `RequestOutput` deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeinfer.engine.detokenizer import IncrementalDetokenizer
from edgeinfer.engine.scheduler import Request
from edgeinfer.engine.tokenizer import Tokenizer
from edgeinfer.types import FinishReason, RequestOutput, Timeline, TokenLogprob, Usage


@dataclass
class OutputState:
    """What the engine remembers per request between steps, beside the scheduler's `Request`."""

    request_id: str
    detok: IncrementalDetokenizer
    stop: list[str]
    include_stop: bool
    timeline: Timeline
    num_prompt_tokens: int
    text: str = ""  # all output text decoded so far (possibly ahead of what was emitted)
    emitted: int = 0  # characters of `text` already sent
    stopped_by_string: bool = False
    sent_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def holdback(self) -> int:
        """Characters kept back while streaming: the longest stop string could be starting there."""
        return max((len(s) for s in self.stop), default=1) - 1


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, OutputState] = {}

    def add(self, req: Request, arrival: float) -> None:
        s = req.sampling
        self.states[req.request_id] = OutputState(
            request_id=req.request_id,
            detok=IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, s.skip_special_tokens),
            stop=list(s.stop),
            include_stop=s.include_stop_str_in_output,
            timeline=Timeline(arrival=arrival),
            num_prompt_tokens=req.num_prompt_tokens,
            prompt_logprobs=[None] if s.prompt_logprobs is not None else None,
        )

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def fail(self, req: Request, message: str, now: float) -> RequestOutput:
        """The last output of a request that failed: no text (its decoder may be what failed), the error."""
        st = self.states.pop(req.request_id)
        st.timeline.finished = now
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[],
            text_delta="",
            finished=True,
            finish_reason=FinishReason.ERROR,
            usage=Usage(st.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens),
            timeline=st.timeline,
            error=message,
        )

    def add_prompt_logprobs(self, request_id: str, lps: list[TokenLogprob]) -> None:
        st = self.states.get(request_id)
        if st is not None and st.prompt_logprobs is not None:
            st.prompt_logprobs.extend(lps)

    def on_tokens(self, req: Request, n: int, logprobs: list[TokenLogprob], now: float) -> int | None:
        """Decode the request's `n` newest tokens in order (`logprobs`: theirs, where asked). If a stop
        string ends the text (cut there) at one of them, returns how many of the `n` it keeps."""
        st = self.states[req.request_id]
        if st.timeline.first_token is None:
            st.timeline.first_token = now
            st.timeline.first_scheduled = req.first_scheduled_time
        tokens = req.output_token_ids[len(req.output_token_ids) - n :]
        for i, token in enumerate(tokens):
            if i < len(logprobs):
                st.pending_logprobs.append(logprobs[i])
            if self._on_token(st, req, token, last=i == n - 1):
                return i + 1
        return None

    def _on_token(self, st: OutputState, req: Request, token: int, last: bool) -> bool:
        """Decode one token; True if a stop string ended the text (already cut)."""
        before = len(st.text)
        if last and req.is_finished and token in req.eos_token_ids:
            return False  # end of turn: not text, even when special tokens are kept in the text
        st.text += st.detok.add([token])
        if not st.stop:
            return False
        start = max(0, before - st.holdback)
        hits = [(i, s) for s in st.stop if (i := st.text.find(s, start)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        st.text = st.text[: i + len(s)] if st.include_stop else st.text[:i]
        st.stopped_by_string = True
        return True

    def make_output(self, req: Request, now: float) -> RequestOutput:
        """The delta since the last output of this request; forgets the request once it finished."""
        st = self.states[req.request_id]
        finished = req.is_finished
        if finished and not st.stopped_by_string:
            st.text += st.detok.flush()  # a held-back partial character, as a full decode would show it
        end = len(st.text) if finished else max(st.emitted, len(st.text) - st.holdback)
        delta, st.emitted = st.text[st.emitted : end], end
        new_ids = req.output_token_ids[st.sent_tokens :]
        st.sent_tokens = len(req.output_token_ids)
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            usage=Usage(st.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens),
            logprobs=st.pending_logprobs,
            timeline=st.timeline,
        )
        st.pending_logprobs = []
        if st.prompt_logprobs is not None and not st.prompt_logprobs_sent and new_ids:
            out.prompt_logprobs, st.prompt_logprobs_sent = st.prompt_logprobs, True
        if finished:
            st.timeline.finished = now
            del self.states[req.request_id]
        return out
