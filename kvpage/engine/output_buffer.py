"""The outputs a step returns: one progress output per sample and token for streaming (offline
callers turn them off), and each request's final output once every sample of it is done."""

from __future__ import annotations

from kvpage.engine.outputs import Decode, RequestOutput, final_output, progress_output
from kvpage.engine.requests import Requests
from kvpage.engine.sequence import Sequence


class OutputBuffer:
    def __init__(self, requests: Requests, decode: Decode = None) -> None:
        self.requests = requests
        self.decode = decode
        self.emit_progress = True  # per-token outputs for streaming; offline callers turn it off
        self._outputs: list[RequestOutput] = []  # finished or progressed since the last take

    def progress(self, seq: Sequence, new_tokens: list[int]) -> None:
        """One sample's tokens of this step (callers ask `emit_progress` first)."""
        self._outputs.append(progress_output(seq, new_tokens))

    def finished(self, seq: Sequence, new_tokens: list[int]) -> None:
        """`seq` ended with `new_tokens` not reported yet. One sample of a parallel request is
        done; the request is once every sample is (one that ends before its fork has only
        sample 0), and it leaves the live requests then."""
        if seq.params.n == 1:
            self._outputs.append(final_output([seq], new_tokens, self.decode))
            self.requests.retire(seq.request_id)
            return
        if self.emit_progress:
            self.progress(seq, new_tokens)
        samples = self.requests.samples[seq.request_id]
        if all(s.finished for s in samples):
            self._outputs.append(final_output(samples, [], self.decode))
            self.requests.retire(seq.request_id)

    def take(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out
