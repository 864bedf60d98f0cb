"""Prompt ids for one lane, built incrementally per session, with the server's outputs spliced in.

A session's next prompt usually extends its previous one (previous prompt + output + new input),
so only the tail is generated (a 250K-token prompt costs a few thousand new ids, not 250K):

    previous prompt ids (kept)          | output of previous request | new input
    [0, len(previous))                  | spliced: the ids the server returned (ignore_eos gives
                                        | exactly max_tokens), else the workload's synthetic ids

The previous prompt is reused only when it lies wholly inside the request's ideal shared prefix;
after a compaction the context restarts and the prompt is built from scratch. Only the lane's
main session and its current sub-agent session are kept, so memory stays at two prompts a lane.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flashpd.bench.tokens import TokenSpace
from flashpd.bench.workload import Request


class PromptBuilder:
    def __init__(self, token_space: TokenSpace, splice_outputs: bool) -> None:
        self.token_space = token_space
        self.splice_outputs = splice_outputs
        self._last: dict[str, np.ndarray] = {}  # session -> its last prompt ids
        self._outputs: dict[str, np.ndarray] = {}  # session -> server output of that prompt

    def build(self, request: Request) -> np.ndarray:
        previous = self._last.get(request.session_id)
        output = self._outputs.pop(request.session_id, None)
        if previous is not None and len(previous) <= request.ideal_cached_tokens:
            tail = self.token_space.prompt_slice(request.segments, len(previous), request.prompt_tokens)
            if output is not None and len(previous) + len(output) <= request.ideal_cached_tokens:
                tail[: len(output)] = output
            ids = np.concatenate([previous, tail])  # [prompt_tokens]
        else:
            ids = self.token_space.prompt_array(request.segments)  # [prompt_tokens]
        self._keep(request, ids)
        return ids

    def record_output(self, request: Request, output_ids: Sequence[int]) -> None:
        """The server's output for the request just built; spliced into the session's next prompt."""
        if self.splice_outputs:
            self._outputs[request.session_id] = np.asarray(output_ids, dtype=np.int64)

    def clear(self) -> None:
        self._last.clear()
        self._outputs.clear()

    def _keep(self, request: Request, ids: np.ndarray) -> None:
        keep = {request.session_id, request.parent_session_id}
        for session in [s for s in self._last if s not in keep]:
            del self._last[session]
            self._outputs.pop(session, None)
        self._last[request.session_id] = ids
